"""`llama-fp8 launch`'s restart decisions (cluster/launch/elastic.py), with a real torchrun agent and stand-in workers
(standin.py: a few lines of Python that report a step and exit as told, so each case takes seconds). Two
launchers on localhost: test_elastic_nodes.py; the batch script's reading of the decisions: test_job_outcome.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from standin import attempts, launch, outcome, prepare

from helpers import REPO, cli_env
from llama_fp8.telemetry import heartbeat


def test_the_stand_in_follows_the_launchers_restart_when_it_missed_an_attempt(tmp_path):
    """A worker killed before it ran (the launcher saw its peer's hang first, on a loaded machine) left no line in
    attempts.txt: in the restart it must still act on the restart's plan, not on the attempt it never ran. Before,
    rank 0 counted its own lines, waited again as in attempt 0, and the launcher called the hang deterministic
    (test_a_live_rank_without_progress_is_named_and_killed_at_once failed so in a full run, exit 137)."""
    prepare(tmp_path, {"0": {"0": 7}, "1": {"0": 0}})
    (tmp_path / "attempts.txt").write_text("0 1\n")  # attempt 0: rank 1 ran, rank 0 was killed before it wrote
    env = cli_env(RANK="0", TORCHELASTIC_RESTART_COUNT="1")
    r = subprocess.run([sys.executable, str(tmp_path / "worker.py"), str(tmp_path)], env=env, timeout=60)
    assert r.returncode == 0  # attempt 1's plan (exit 0), not attempt 0's (exit 7)
    # the job's attempts count the one rank 0 missed (test_the_same_step_failing_again_... failed so in a CI run)
    with open(tmp_path / "attempts.txt", "a") as f:
        f.write("1 1\n")  # rank 1 in attempt 1
    assert (attempts(tmp_path), attempts(tmp_path, 0), attempts(tmp_path, 1)) == (2, 1, 2)


@pytest.mark.slow
def test_a_crash_restarts_every_rank_and_the_job_succeeds(tmp_path):
    """... and the launcher leaves no folder in the node's temporary folder (torch's log folder, one a job step
    and node, with a folder per attempt: gone when nothing was asked to be logged there)."""
    (tmp_path / "tmp").mkdir()
    rc, err = launch(tmp_path, {"0": {"1": "kill"}}, TMPDIR=str(tmp_path / "tmp"))
    assert rc == 0, err[-2000:]
    assert not list((tmp_path / "tmp").iterdir())
    assert attempts(tmp_path) == 2
    assert "rank 1 (killed by SIGKILL) in step 5; charged to node" in err and "(1 of 2 without a new checkpoint (the latest complete: none yet)); " \
           "restarting the workers of every node (restart 1 of the job, 1 of 3 without a new checkpoint)" in err
    assert outcome(tmp_path) == (0, "done", "training finished on every node")


@pytest.mark.slow
def test_the_restart_budget_is_the_jobs_and_ends_with_the_crash_code(tmp_path):
    """Four crashes at four different steps with --max_restarts 3: three restarts, then the job stops."""
    rc, err = launch(tmp_path, {**{str(a): {"0": 1} for a in range(5)}, "steps": {"0": 1, "1": 2, "2": 3, "3": 4}})
    assert rc == 1 and attempts(tmp_path) == 4, err[-2000:]
    assert "restart 3 of the job, 3 of 3 without a new checkpoint" in err
    assert "in step 4; the job's 3 restart(s) without a new checkpoint are used up: not restarting, the job ends with " \
           "exit 1" in err
    assert outcome(tmp_path)[:2] == (1, "fail")


@pytest.mark.parametrize("code,action", [(2, "fail"), (3, "fail"), (85, "requeue")])
@pytest.mark.slow
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


@pytest.mark.slow
def test_a_live_rank_without_progress_is_named_and_killed_at_once(tmp_path):
    """Rank 1 sleeps (a hang) while rank 0 moves: rank 1 is named at once, without any failure (it has reported no
    progress for 60 s with 0.5 s steps: bound 15 s), and both are killed with SIGKILL (torch would send SIGTERM,
    which our workers read as "save", and wait 30 s): its SIGTERM handler never runs."""
    plan = {"0": {"0": {"exit": "wait", "step_s": 0.5}, "1": {"exit": "wait", "age": 60, "step_s": 0.5,
                                                              "on_term": True}}, "steps": {"0": 5, "1": 6}}
    rc, err = launch(tmp_path, plan)
    assert rc == 0 and attempts(tmp_path) == 2, err[-2000:]
    assert "a hang: rank 1 (" in err and "in step 5, no progress for" in err, err[-2000:]
    assert "rank(s) 0 wait for it" in err, err[-2000:]
    assert not list(tmp_path.glob("sigterm.*")), "the sleeping rank got SIGTERM before SIGKILL"
    assert "closing signal SIGTERM" not in err, err[-2000:]  # torch found it reaped: it sent no SIGTERM at all


@pytest.mark.slow
def test_a_healthy_rank_in_a_long_step_is_not_named(tmp_path):
    """A rank 12 s into a step when its peer fails, its previous step having taken 20 s (a GPU step, a save): it is
    moving, and must not be named as the rank that stopped (the limit scales with the step's own duration)."""
    plan = {"0": {"0": 1, "1": {"exit": "wait", "age": 12, "step_s": 20}}, "steps": {"0": 5, "1": 6}}
    rc, err = launch(tmp_path, plan)
    assert rc == 0 and attempts(tmp_path) == 2, err[-2000:]
    assert "stopped moving" not in err, err[-2000:]


@pytest.mark.slow
def test_a_start_up_failure_twice_is_requeued_not_called_deterministic(tmp_path):
    """A rank that fails before its first progress record, in two attempts in a row (a GPU that does not
    initialize, memory still held by a killed process): the machine, not the data or the code. No third attempt
    in place, and the job is requeued (action retry, bounded by MAX_REQUEUES), not failed for good."""
    dead = {"0": {"exit": 1, "phase": None}, "1": {"exit": "wait", "phase": None}}
    rc, err = launch(tmp_path, {"0": dead, "1": dead})
    assert rc == 1 and attempts(tmp_path) == 2, err[-2000:]
    code, action, line = outcome(tmp_path)
    assert (code, action) == (1, "retry"), line
    assert "during start-up again after a restart" in line and "deterministic" not in line


@pytest.mark.parametrize("nan_after_s", [0, 2], ids=["together", "3-after-85"])
def test_a_deterministic_code_wins_over_a_stop_signal(tmp_path, nan_after_s):
    """SIGUSR1 arrives; rank 1 saves and exits 85 at once, rank 0 stops on its NaN (3) with it or two seconds later:
    the job fails with 3 once, it is not requeued into the same NaN, and the line names rank 0. The later 3 needs
    the launcher to wait for every worker's own exit (torch's poll closes the others with SIGTERM on the first
    failure it sees: the old launcher ended with 85)."""
    plan = {"0": {"0": {"exit": "wait", "on_usr1": 3, "usr1_s": nan_after_s}, "1": {"exit": "wait", "on_usr1": 85}}}
    p = launch(tmp_path, plan, wait=False)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"started.0.{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 3 and attempts(tmp_path) == 1, err[-2000:]
    assert outcome(tmp_path)[:2] == (3, "fail")
    assert "rank 0 (exit 3" in err and "the job ends with exit 3" in err, err[-2000:]


@pytest.mark.parametrize(("flags", "removed"), [({}, True), ({"redirects": "3"}, False), ({"tee": "1"}, False),
                                              ({"log_dir": "/logs"}, False)])
def test_torchs_log_folder_is_removed_only_when_nothing_was_asked_to_be_logged_there(flags, removed):
    from types import SimpleNamespace

    from llama_fp8.cluster.launch.torchrun import _torch_log_dir

    args = SimpleNamespace(**{"log_dir": None, "redirects": "0", "tee": "0", **flags})
    agent = SimpleNamespace(_logs_specs=SimpleNamespace(root_log_dir="/tmp/torchelastic_abc123"))
    assert _torch_log_dir(agent, args) == ("/tmp/torchelastic_abc123" if removed else None)
    other = SimpleNamespace(_logs_specs=SimpleNamespace(root_log_dir="/scratch/my-logs"))
    assert _torch_log_dir(other, args) is None  # a folder torch did not make for us is never removed


@pytest.mark.slow
def test_the_failure_is_placed_at_the_failed_ranks_step(tmp_path):
    """Rank 1 fails in step 5 while rank 0, which the launcher then kills, already reported step 6: the failure
    is in step 5 (the killed rank's step would make a repeated failure look like progress)."""
    plan = {"0": {"1": {"exit": 1, "step": 5}, "0": {"exit": "wait", "step": 6, "step_s": 0.5}}}
    rc, err = launch(tmp_path, plan)
    assert rc == 0, err[-2000:]
    assert "rank 1 (exit 1) in step 5; restarting the workers of every node" in err, err[-2000:]


@pytest.mark.slow
def test_a_signal_death_is_named_before_a_peers_exit_1(tmp_path):
    """Rank 1 is SIGKILLed and rank 0 exits 1 as it sees its peer gone (gloo's error), both seen in one look of
    the launcher (torch's failure times are whole seconds, ties went to the lowest rank): the SIGKILL is named."""
    plan = {"0": {"1": "kill", "0": {"exit": 1, "peer_gone": 1, "after": 0}}}
    rc, err = launch(tmp_path, plan, monitor_interval=2)
    assert rc == 0, err[-2000:]
    assert "rank 1 (killed by SIGKILL) in step 5; charged to node" in err, err[-2000:]


def patched_launcher(code: str) -> list[str]:
    """`python -m llama_fp8` with ``code`` run first (it patches torch to stage a case torch cannot be told to
    produce on demand)."""
    return [sys.executable, "-c", f"import sys\n{code}\nfrom llama_fp8.__main__ import main\nsys.exit(main(sys.argv[1:]))"]


@pytest.mark.slow
def test_torchs_uninterruptible_sleep_guard_is_respected(tmp_path):
    """torch's agent marks the workers UNHEALTHY and sets its restarts to 0 when one stays in uninterruptible
    sleep (D state: it holds its GPU); here every worker reads as D. No restart onto the held device, and not
    "training finished" either (torch's run() returns normally in that case): exit 1, requeued (retry)."""
    code = ("from torch.distributed.elastic.agent.server import local_elastic_agent as L\n"
            "L.read_proc_state = lambda pid: 'D'")
    rc, err = launch(tmp_path, {"0": {"0": "wait", "1": "wait"}}, python=patched_launcher(code),
                     TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT="0.5", LLAMA_FP8_HANG_FACTOR="0")  # the guard alone
    assert attempts(tmp_path) == 1 and rc == 1, err[-2000:]
    code_, action, line = outcome(tmp_path)
    assert (code_, action) == (1, "retry") and "uninterruptible sleep" in line, line


def test_a_signal_while_workers_start_reaches_them(tmp_path):
    """SIGUSR1 between the launcher's "no signal yet" check and torch storing the new workers (staged by sending it
    from torch's _start_workers): the new workers get it too, and the job exits 85 instead of training on."""
    code = ("import os, signal\n"
            "from torch.distributed.elastic.agent.server import local_elastic_agent as L\n"
            "orig = L.LocalElasticAgent._start_workers\n"
            "def start(self, wg):\n"
            "    os.kill(os.getpid(), signal.SIGUSR1)\n"
            "    return orig(self, wg)\n"
            "L.LocalElasticAgent._start_workers = start")
    p = launch(tmp_path, {"0": {"0": "wait", "1": "wait"}}, python=patched_launcher(code), wait=False)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the workers never got the signal: still running after 60 s")
    assert p.returncode == 85 and attempts(tmp_path) <= 1, err[-2000:]  # 0: killed before its first line
    assert "(killed by SIGUSR1) after SIGUSR1: not restarting" in err, err[-2000:]
    assert outcome(tmp_path)[:2] == (85, "retry")


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


def test_the_launcher_refuses_a_torch_whose_agent_it_cannot_replace(tmp_path):
    """The launcher's decisions live in its agent class, which torch's launch_agent builds by the module name
    LocalElasticAgent. A torch whose launch_agent builds its agent otherwise (staged: a wrapper in its place)
    would run the job with torch's plain restarts (exit 2 and 3 restarted, a budget per node): the launcher stops
    before any worker starts, exit 2, naming the torch version."""
    code = ("from torch.distributed.launcher import api\n"
            "orig = api.launch_agent\n"
            "def launch_agent(config, entrypoint, args, *rest):\n"
            "    return orig(config, entrypoint, args, *rest)\n"
            "api.launch_agent = launch_agent")
    rc, err = launch(tmp_path, {"0": {"0": 3, "1": 3}}, python=patched_launcher(code))
    assert rc == 2 and attempts(tmp_path) == 0, err[-3000:]
    assert "torch 2." in err and "launch_agent" in err, err[-3000:]
    assert outcome(tmp_path)[:2] == (2, "fail")


def test_the_agents_shutdown_passes_on_what_each_torch_gives_it(monkeypatch):
    """On a GPU node with torch 2.11 every `llama-fp8 launch` ended in a TypeError from the agent's shutdown: it
    passed torch 2.13's timeout argument on to torch 2.11's ``_shutdown(self, death_sig=SIGTERM)``, after a
    finished job and after a failed rank alike. Each torch's parent is staged with its own signature and called
    as that torch's run() and _stop_workers() call it."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from llama_fp8.cluster.launch import elastic

    calls, killed = [], []

    def torch_2_11(self, death_sig=signal.SIGTERM):
        calls.append((death_sig,))

    def torch_2_13(self, death_sig=signal.SIGTERM, timeout=30):
        calls.append((death_sig, timeout))

    agent = object.__new__(elastic.JobAgent)
    monkeypatch.setattr(elastic.JobAgent, "kill_running", lambda self: killed.append(1))
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", torch_2_11)
    agent._shutdown()  # torch 2.11: run()'s end and _stop_workers()
    agent._shutdown(signal.SIGINT)  # torch 2.11: a signal
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", torch_2_13)
    agent._shutdown(signal.SIGTERM, timeout=12)  # torch 2.13: run()'s end
    assert calls == [(signal.SIGTERM,), (signal.SIGINT,), (signal.SIGTERM, 12)]
    assert len(killed) == 2  # SIGTERM without a stop signal: the workers are killed first, as before


def test_the_agent_checks_the_rendezvous_round_and_its_workers():
    """The two other internals: the round of torch's dynamic rendezvous (the job-wide budget; a static
    rendezvous has none, and counts per agent as torch does), and the worker processes (SIGKILL, naming, signal
    forwarding). Missing, each stops the job (exit 2) naming the torch version instead of going on without."""
    from types import SimpleNamespace

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from llama_fp8.cluster.launch import elastic

    agent = object.__new__(elastic.JobAgent)
    agent._worker_group = SimpleNamespace(spec=SimpleNamespace(
        rdzv_handler=object.__new__(DynamicRendezvousHandler), max_restarts=3, local_world_size=2))
    with pytest.raises(elastic.JobStop) as e:
        agent._round()
    assert e.value.code == 2 and "rendezvous round" in e.value.line and "torch 2." in e.value.line
    agent._worker_group.spec.rdzv_handler = SimpleNamespace()  # a static rendezvous: no rounds, its own count
    agent.restarts = 1
    assert agent._round() == 1
    agent._pcontext = SimpleNamespace(close=lambda *a, **k: None)  # workers kept where the agent cannot see them
    with pytest.raises(elastic.JobStop) as e:
        agent._check_workers()
    assert e.value.code == 2 and "worker processes" in e.value.line and "torch 2." in e.value.line
    elastic.check_torch()  # the torch installed here passes


def test_heartbeat_round_trip_and_foreign_files_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv(heartbeat.ENV, str(tmp_path))
    now = [90.0]
    monkeypatch.setattr(heartbeat.time, "time", lambda: now[0])
    saved = [None]
    beat = heartbeat.Heartbeat(3, lambda: saved[0])
    beat.beat(0, "startup")                   # t=90: the process's first line
    now[0] = 95.0
    beat.beat(6, "startup")                   # t=95: built and resumed from step 6: start-up goes on
    now[0] = 100.0
    beat.beat(7, "step")                      # t=100: start-up took 10 s
    now[0] = 104.5
    saved[0] = 6
    beat.beat(7, "save")                      # t=104.5: step 7 (the attempt's first) took 4.5 s
    got = heartbeat.read(tmp_path)[3]
    assert {k: got[k] for k in ("rank", "step", "phase", "time", "since", "step_s", "step_max_s", "ckpt")} == {
        "rank": 3, "step": 7, "phase": "save", "time": 104.5, "since": 104.5, "step_s": 4.5, "step_max_s": None,
        "ckpt": 6}
    assert got["took"] == {"startup": 10.0, "first_step": 4.5} and got["pid"] == os.getpid()
    now[0] = 130.0
    beat.beat(8, "step")                      # t=130: the save's 25.5 s are not a step's
    now[0] = 131.0
    beat.beat(9, "step")                      # t=131: step 8 took 1 s: the first measure of the recent steps
    now[0] = 131.5
    beat.beat(9, "finished")
    got = heartbeat.read(tmp_path)[3]
    assert (got["phase"], got["step_s"], got["step_max_s"], got["took"]["save"]) == ("finished", 0.5, 1.0, 25.5)
    beat.failed("io", "OSError: [Errno 5] Input/output error")
    assert heartbeat.read(tmp_path)[3]["error"] == {"kind": "io", "line": "OSError: [Errno 5] Input/output error"}
    (tmp_path / "rank4.json").write_text("{not json")
    (tmp_path / "rank5.json").write_text(json.dumps({"rank": 5, "step": "x"}))
    (tmp_path / "rank6.json").write_bytes(b" " * (heartbeat.MAX_BYTES + 1))
    assert list(heartbeat.read(tmp_path)) == [3]
    assert heartbeat.number({"a": True, "b": 2, "c": "3"}, "a") is None and heartbeat.number({"b": 2}, "b") == 2
    monkeypatch.delenv(heartbeat.ENV)
    heartbeat.Heartbeat(0).beat(1, "step")  # no folder: nothing written, nothing raised
    assert not (tmp_path / "rank0.json").exists()


def test_the_progress_thread_counts_collectives_and_shows_a_long_data_wait(tmp_path, monkeypatch):
    """A collective issued is progress (the thread sees torch's sequence number move while the training thread may
    be blocked); a step waiting for data longer than DATA_AFTER_S shows the phase ``data``, and the step again once
    the data came."""
    import torch
    import torch.distributed as dist

    monkeypatch.setenv(heartbeat.ENV, str(tmp_path))
    fresh = not dist.is_initialized()
    if fresh:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        beat = heartbeat.Heartbeat(0)
        beat.beat(1, "step")
        beat.tick()
        before = heartbeat.read(tmp_path)[0]["seq"]
        dist.all_reduce(torch.ones(1))
        beat.tick()
        after = heartbeat.read(tmp_path)[0]["seq"]
        assert sum(after.values()) == sum(before.values()) + 1, (before, after)
        monkeypatch.setattr(heartbeat, "DATA_AFTER_S", 0.0)
        with beat.data_wait():
            beat.tick()
            assert heartbeat.read(tmp_path)[0]["phase"] == "data"
        beat.tick()
        rec = heartbeat.read(tmp_path)[0]
        assert rec["phase"] == "step" and rec["time"] >= rec["since"]
    finally:
        if fresh:
            dist.destroy_process_group()


def test_the_flight_recorder_dumps_into_the_run_folder_when_it_is_on(tmp_path, monkeypatch):
    """The dump path (torch appends the rank) in the run folder whenever the recorder is on, on gloo too; off
    without TORCH_FR_BUFFER_SIZE. What a dump holds is checked on a real hang: test_hangs.py."""
    from llama_fp8 import config
    from llama_fp8.train import flight_recorder
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "20000")
    cfg = config.parse_args(["--model", "tiny", "--device", "cpu", "--run_dir", str(tmp_path / "run")])
    assert flight_recorder.set_dump_path(cfg) == str(tmp_path / "run" / "comm_traces" / "rank_")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "comm_traces" / "rank_")
    assert (tmp_path / "run" / "comm_traces").is_dir()
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    assert flight_recorder.set_dump_path(cfg) is None and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ


@pytest.mark.slow
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
    assert "restart 1 of the job, 1 of 1 without a new checkpoint" in p.stderr and "already holds metrics.jsonl" not in p.stderr
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 1, 2, 3]  # step 1 trained twice


@pytest.mark.slow
def test_a_peer_dying_after_training_finished_lets_the_others_write_their_last_records(tmp_path):
    """Both ranks report `finished`; rank 1 is SIGKILLed at once while rank 0 still closes its records (2 s).
    Before: the crash killed rank 0 too (a finished run's last goodput and metrics records lost, the job "done").
    Now rank 0 gets to its end, and the job is done in one attempt."""
    plan = {"0": {"0": {"phase": "finished", "exit": 0, "after": 2, "mark": True},
                  "1": {"phase": "finished", "exit": "kill"}}}
    rc, err = launch(tmp_path, plan)
    assert rc == 0 and attempts(tmp_path) == 1, err[-2000:]
    assert (tmp_path / "exited.0.0").exists(), err[-2000:]
    assert "rank 1 (killed by SIGKILL) after training finished" in err, err[-2000:]
    assert outcome(tmp_path)[:2] == (0, "done")


@pytest.mark.slow
def test_a_peer_dying_while_the_hang_watch_looks_still_lets_the_others_finish(tmp_path):
    """The same, rank 1 dying while the launcher's hang watch looks (staged: the look waits for its death). Torch's
    poll after the look closes every worker on the first failure it sees (SIGTERM): the launcher looks for dead
    workers again after its watch, so that the finished case is still its own. Before, rank 0 got torch's SIGTERM
    (seen in a CI run: a crash between the launcher's look at its workers and torch's)."""
    code = ("import os, pathlib, time\n"
            "from llama_fp8.cluster.launch import hangs\n"
            "orig = hangs.HangWatch.look\n"
            "def look(self):\n"
            "    here = pathlib.Path(sys.argv[-1])\n"
            "    started = here / 'started.0.1'\n"
            "    if started.exists() and not (here / 'looked').exists():\n"
            "        pid = int(started.read_text().split()[0])\n"
            "        while os.path.exists(f'/proc/{pid}') and \\\n"
            "                open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z':\n"
            "            time.sleep(0.01)\n"
            "        (here / 'looked').touch()\n"
            "    return orig(self)\n"
            "hangs.HangWatch.look = look")
    plan = {"0": {"0": {"phase": "finished", "exit": 0, "after": 2, "mark": True},
                  "1": {"phase": "finished", "exit": "kill", "after": 0.3}}}
    rc, err = launch(tmp_path, plan, python=patched_launcher(code))
    assert (tmp_path / "looked").exists(), err[-2000:]  # rank 1 died inside the watch's look
    assert rc == 0 and attempts(tmp_path) == 1, err[-2000:]
    assert (tmp_path / "exited.0.0").exists() and "closing signal SIGTERM" not in err, err[-2000:]
    assert "rank 1 (killed by SIGKILL) after training finished" in err, err[-2000:]


@pytest.mark.slow
def test_a_rank_killed_after_training_finished_is_not_restarted(tmp_path):
    """Real training under the launcher, rank 1 SIGKILLed once it reported `finished` (the final checkpoint
    complete, as in a crash in teardown): the job ends done, no second attempt, the checkpoint of the last step
    in place."""
    from helpers import train_records
    cmd = [sys.executable, "-m", "llama_fp8", "launch", "--standalone", "--nproc_per_node=2", "--max_restarts=1",
           "-m", "llama_fp8", "train", "--model", "tiny", "--device", "cpu", "--num_layers", "2",
           "--max_context_width", "32", "--train_batch_size", "2", "--max_steps", "2", "--checkpoint_freq", "2",
           "--logging_freq", "1", "--run_dir", str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240, env=cli_env(
        LLAMA_FP8_FAULT="kill@finished:rank=1", LLAMA_FP8_FAULT_DIR=str(tmp_path),
        LLAMA_FP8_OUTCOME_DIR=str(tmp_path / "outcome")))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rank 1 (killed by SIGKILL) after training finished" in p.stderr, p.stderr[-3000:]
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 2]  # one attempt
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "COMPLETE").is_file()
    (f,) = (tmp_path / "outcome").iterdir()
    assert f.read_text().split(" ", 3)[:3] == ["0", "done", "2"], f.read_text()  # the latest checkpoint: step 2
