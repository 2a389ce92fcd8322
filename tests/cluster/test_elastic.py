"""`llama-fp8 launch`'s restart decisions (cluster/elastic.py), with real torchrun agents and stand-in workers
(a few lines of Python that report a step and exit as told, so each case takes seconds), and the batch script's
reading of them (job_lib.sh lf_outcome)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import REPO, cli_env
from llama_fp8.telemetry import heartbeat

# A worker: appends "attempt rank" to attempts.txt, reports `step` in its progress file, then acts on the plan:
# {attempt: {rank: action}} with action an exit code, "kill" (SIGKILL itself), "wait" (sleep until killed).
WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    here = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    with open(here / "attempts.txt", "a") as f:
        f.write(f"{os.environ['TORCHELASTIC_RESTART_COUNT']} {rank}\\n")
    attempt = sum(1 for line in open(here / "attempts.txt") if line.split()[1] == str(rank)) - 1
    plan = json.loads((here / "plan.json").read_text())
    todo = plan.get(str(attempt), {}).get(str(rank), 0)
    step = plan.get("steps", {}).get(str(attempt), 5)
    folder = os.environ.get("LLAMA_FP8_PROGRESS_DIR")
    if folder:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "step": step, "phase": "step", "time": time.time() - (60 if todo == "wait" else 0),
             "pid": os.getpid()}))
    (here / f"started.{attempt}.{rank}").touch()
    if todo == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if todo == "wait":
        time.sleep(120)
    time.sleep(0.3)
    sys.exit(todo)
""")


def launch(tmp_path: Path, plan: dict, max_restarts: int = 3, nproc: int = 2, wait: bool = True, **env):
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "attempts.txt").write_text("")
    cmd = [sys.executable, "-m", "llama_fp8", "launch", "--standalone", f"--nproc_per_node={nproc}",
           f"--max_restarts={max_restarts}", "--monitor_interval=0.1", str(tmp_path / "worker.py"), str(tmp_path)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                         env=cli_env(LLAMA_FP8_OUTCOME_DIR=str(tmp_path / "outcome"), **env))
    if not wait:
        return p
    out, err = p.communicate(timeout=120)
    return p.returncode, err


def attempts(tmp_path: Path) -> int:
    lines = (tmp_path / "attempts.txt").read_text().split("\n")
    return sum(1 for ln in lines if ln.endswith(" 0"))


def outcome(tmp_path: Path) -> tuple[int, str, str]:
    (f,) = list((tmp_path / "outcome").iterdir())
    code, action, line = f.read_text().strip().split(" ", 2)
    return int(code), action, line


def test_a_crash_restarts_every_rank_and_the_job_succeeds(tmp_path):
    rc, err = launch(tmp_path, {"0": {"1": "kill"}})
    assert rc == 0, err[-2000:]
    assert attempts(tmp_path) == 2
    assert "rank 1 (killed by SIGKILL) in step 5; restarting the workers of every node (restart 1 of 3 for the " \
           "job)" in err
    assert outcome(tmp_path) == (0, "done", "training finished on every node")


def test_the_restart_budget_is_the_jobs_and_ends_with_the_crash_code(tmp_path):
    """Four crashes at four different steps with --max_restarts 3: three restarts, then the job stops."""
    rc, err = launch(tmp_path, {**{str(a): {"0": 1} for a in range(5)}, "steps": {"0": 1, "1": 2, "2": 3, "3": 4}})
    assert rc == 1 and attempts(tmp_path) == 4, err[-2000:]
    assert "restart 3 of 3 for the job" in err
    assert "rank 0 (exit 1) in step 4; the job's 3 restart(s) are used up: not restarting, the job ends with " \
           "exit 1" in err
    assert outcome(tmp_path)[:2] == (1, "fail")


@pytest.mark.parametrize("code,action", [(2, "fail"), (3, "fail"), (85, "requeue")])
def test_deterministic_codes_and_the_requeue_code_are_never_restarted(tmp_path, code, action):
    rc, err = launch(tmp_path, {"0": {"0": code, "1": code}})
    assert rc == code and attempts(tmp_path) == 1, err[-2000:]
    assert outcome(tmp_path)[:2] == (code, action)
    assert "not restarting" in err


def test_the_same_step_failing_again_after_a_restart_is_not_restarted_again(tmp_path):
    rc, err = launch(tmp_path, {"0": {"1": "kill"}, "1": {"1": "kill"}, "2": {"1": "kill"}})
    assert rc == 128 + signal.SIGKILL and attempts(tmp_path) == 2, err[-2000:]
    assert "rank 1 (killed by SIGKILL) in step 5 again after a restart: the failure is deterministic" in err
    assert outcome(tmp_path)[:2] == (137, "fail")


def test_a_live_rank_without_progress_is_named_and_killed_at_once(tmp_path):
    """Rank 0 exits 1 while rank 1 sleeps (a hang): rank 1 is killed with SIGKILL right away (torch would send
    SIGTERM and wait 30 s) and named, as it has reported no progress for 60 s."""
    plan = {"0": {"0": 1, "1": "wait"}, "steps": {"0": 5, "1": 6}}
    t0 = time.monotonic()
    rc, err = launch(tmp_path, plan)
    assert rc == 0 and attempts(tmp_path) == 2, err[-2000:]
    assert time.monotonic() - t0 < 25, "the sleeping rank was not killed at once"
    assert "stopped moving: state S in step 5, no progress for" in err, err[-2000:]


def test_sigusr1_stops_restarts_and_asks_for_a_requeue(tmp_path):
    """A time-limit warning (SIGUSR1) to the launcher while its workers run: they get it (and here die of it: no
    handler), and the launcher exits 85 instead of restarting them."""
    p = launch(tmp_path, {"0": {"0": "wait", "1": "wait"}}, wait=False)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"started.0.{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 85 and attempts(tmp_path) == 1, err[-2000:]
    assert "received SIGUSR1" in err and "not restarting; exit 85" in err
    assert outcome(tmp_path)[:2] == (85, "retry"), "nothing was saved: a requeue bounded by MAX_REQUEUES"


def test_heartbeat_round_trip_and_foreign_files_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv(heartbeat.ENV, str(tmp_path))
    beat = heartbeat.Heartbeat(3)
    beat.beat(7, "step")
    (tmp_path / "rank4.json").write_text("{not json")
    (tmp_path / "rank5.json").write_text(json.dumps({"rank": 5, "step": "x"}))
    (tmp_path / "rank6.json").write_bytes(b" " * (heartbeat.MAX_BYTES + 1))
    got = heartbeat.read(tmp_path)
    assert list(got) == [3] and got[3]["step"] == 7 and got[3]["phase"] == "step" and got[3]["pid"] == os.getpid()
    monkeypatch.delenv(heartbeat.ENV)
    heartbeat.Heartbeat(0).beat(1, "step")  # no folder: nothing written, nothing raised
    assert not (tmp_path / "rank0.json").exists()


def test_flight_recorder_dumps_into_the_run_folder_on_cuda_only(tmp_path, monkeypatch):
    from llama_fp8 import config as C
    from llama_fp8 import train as T
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "20000")
    cfg = C.parse_args(["--model", "tiny", "--device", "cuda", "--run_dir", str(tmp_path / "run")])
    assert T.flight_recorder_path(cfg) == str(tmp_path / "run" / "comm_traces" / "rank_")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "comm_traces" / "rank_")
    assert (tmp_path / "run" / "comm_traces").is_dir()
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    assert T.flight_recorder_path(C.parse_args(["--model", "tiny", "--device", "cpu"])) is None
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    assert T.flight_recorder_path(cfg) is None and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ


def outcome_rc(tmp_path: Path, files: dict[str, str], srun_rc: int, max_requeues: int = 3) -> tuple[int, str]:
    """job_lib.sh's lf_outcome on these outcome files (no Slurm needed: it reads files and the srun code)."""
    folder = tmp_path / "out"
    folder.mkdir(exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    for name, text in files.items():
        (folder / name).write_text(text + "\n")
    script = (f'source {REPO}/scripts/slurm/job_lib.sh; LF_OUTCOME_DIR={folder}; lf_outcome {srun_rc}; '
              f'echo "rc=$?"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True,
                         env={**os.environ, "SLURM_JOB_ID": "77", "MAX_REQUEUES": str(max_requeues)}).stdout
    return int(out.rsplit("rc=", 1)[1]), out


def test_lf_outcome_requeues_what_it_should_and_caps_the_rest(tmp_path):
    (tmp_path / "logs").mkdir()
    assert outcome_rc(tmp_path, {"node0": "0 done ok", "node1": "0 done ok"}, 0)[0] == 0
    # a deterministic failure on one node wins over the other node's requeue, and over srun's 143
    rc, out = outcome_rc(tmp_path, {"node0": "3 fail rank 0: NaN", "node1": "85 requeue saved"}, 143)
    assert rc == 3 and "rank 0: NaN; not requeued" in out
    # a checkpoint saved after a signal: always requeued, whatever srun said
    assert outcome_rc(tmp_path, {"node1": "85 requeue saved"}, 143)[0] == 85
    # a launcher that failed by itself before deciding (it could not even start): its code, not requeued
    rc, out = outcome_rc(tmp_path, {}, 1)
    assert rc == 1 and "failed with code 1 before its launchers decided (the error is above); not requeued" in out
    # nothing saved (a lost rendezvous host, a launcher killed without a word): MAX_REQUEUES times, then no more
    rc, out = outcome_rc(tmp_path, {}, 137, max_requeues=2)
    assert rc == 85 and "requeue 1 of 2 (MAX_REQUEUES)" in out
    assert outcome_rc(tmp_path, {"node1": "86 retry lost the rendezvous"}, 143, max_requeues=2)[0] == 85
    rc, out = outcome_rc(tmp_path, {"node1": "86 retry lost the rendezvous"}, 143, max_requeues=2)
    assert rc == 143 and "not requeued: 2 requeue(s) without a new checkpoint already (MAX_REQUEUES=2)" in out
    assert len((tmp_path / "logs" / "llama-fp8-requeues_77").read_text().splitlines()) == 2


def test_a_crash_before_the_first_checkpoint_starts_the_job_over(tmp_path):
    """Real training, rank 1 killed in step 1: the restarted attempt finds this job's own metrics.jsonl and no
    checkpoint, and starts over instead of refusing the run dir (which it does for another job's metrics)."""
    from helpers import train_records
    cmd = [sys.executable, "-m", "llama_fp8", "launch", "--standalone", "--nproc_per_node=2", "--max_restarts=1",
           "-m", "llama_fp8", "train", "--model", "tiny", "--device", "cpu", "--num_layers", "2",
           "--max_context_width", "32", "--train_batch_size", "2", "--max_steps", "3", "--checkpoint_freq", "2",
           "--logging_freq", "1", "--run_dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240, env=cli_env(
        LLAMA_FP8_FAULT="kill@step:step=2:rank=1:once", LLAMA_FP8_FAULT_DIR=str(tmp_path)))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "restart 1 of 1 for the job" in p.stderr and "already holds metrics.jsonl" not in p.stderr
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 1, 2, 3]  # step 1 trained twice
