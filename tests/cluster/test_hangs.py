"""Hangs seen by the launcher from the run's own pace, while nothing has failed (cluster/launch/hangs.py): the rank
the others wait for named (not its victims, across nodes too), its flight recorder dumped, the failure charged to
its node; a node charged twice or failing its health check left behind; the restart budget counting only
restarts without progress. Stand-in workers (standin.py) for the decisions, real training for the whole path."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys

import pytest
from standin import attempts, finish, launch, launch_nodes, outcome, outcome_fields

from helpers import REPO, cli_env, train_records


def host_of(tmp_path, rank: int, procs) -> str:
    """The Slurm name (``launch_nodes(names=True)``) of the node whose launcher started ``rank`` in attempt 0."""
    _, parent = map(int, (tmp_path / f"started.0.{rank}").read_text().split())
    return f"n{[p.pid for p in procs].index(parent) + 1}"


@pytest.mark.slow
def test_the_rank_behind_is_named_on_every_node_not_its_victims(tmp_path):
    """Two nodes x two ranks; rank 1 has issued 40 collectives and stopped, the three others 41 (they wait for it in
    the 41st). Its node's launcher sees it stall, names rank 1 only, charges its node; the other node restarts with
    it, repeating the decision. Before: nothing happened until a collective timed out (600 s by default), and then
    every rank blocked in the step was named."""
    waiting = {"exit": "wait", "step_s": 0.2, "seq": {"0": 41}}
    plan = {"0": {"0": waiting, "1": {**waiting, "age": 60, "seq": {"0": 40}}, "2": waiting, "3": waiting}}
    procs = launch_nodes(tmp_path, plan, nproc=2, names=True)
    codes, err = finish(tmp_path, procs)
    assert codes == [0, 0] and attempts(tmp_path, 1) == 2, err[-4000:]
    culprit = host_of(tmp_path, 1, procs)
    assert f"a hang: rank 1 ({culprit}, pid" in err and "1 collective(s) behind the others" in err, err[-4000:]
    assert "rank(s) 0, 2, 3 wait for it (named: behind)" in err, err[-4000:]
    assert "a hang: rank 0 (" not in err and "a hang: rank 2 (" not in err and "a hang: rank 3 (" not in err
    for node in ("node0", "node1"):
        assert outcome_fields(tmp_path, node)["failed"] == [f"{culprit}@0:-"], outcome_fields(tmp_path, node)


@pytest.mark.slow
def test_a_stopped_rank_is_named_when_no_rank_is_behind(tmp_path):
    """No collective counts to compare (every rank reports none): the rank whose process is stopped is named. The
    floor lowered through LLAMA_FP8_HANG_FLOOR_S: with 0.5 s steps the bound is max(5 x 0.5, 2) = 2.5 s."""
    plan = {"0": {"0": {"exit": "wait", "step_s": 0.5}, "1": {"exit": "stop", "step_s": 0.5}}}
    rc, err = launch(tmp_path, plan, LLAMA_FP8_HANG_FLOOR_S="2")
    assert rc == 0 and attempts(tmp_path) == 2, err[-3000:]
    assert "a hang: rank 1 (" in err and "stopped (SIGSTOP) in step 5" in err and "(named: stopped)" in err, err[-3000:]
    # the stopped rank's own bound is told, whether or not it passed it before the rank waiting for it passed its own
    # (as measured: a step of a loaded host takes longer than the planned 0.5 s)
    m = re.search(r"stopped \(SIGSTOP\) in step 5, no progress for \d+ s \(bound (\d+) s: 5 x its recent step time "
                  r"\((\d+\.\d+) s\), at least 2 s\)", err)
    assert m and float(m[2]) >= 0.5 and m[1] == f"{max(5 * float(m[2]), 2):.0f}", err[-3000:]


@pytest.mark.slow
def test_a_node_charged_twice_is_left_behind_instead_of_restarted_a_third_time(tmp_path):
    """Two crashes (SIGKILL: a crash or an OOM kill) on the same node at two steps, no checkpoint between them, no
    spare: the second ends the training step with `retry` and the node's two failures in the outcome (with the
    checkpoint of each), for the batch script to leave it behind where the job can run without it. Before:
    restarted in place again (the budget was 3), on the node that had failed twice."""
    plan = {"0": {"1": "kill"}, "1": {"0": "kill"}, "2": {}, "steps": {"0": 3, "1": 4}}
    rc, err = launch(tmp_path, plan, SLURMD_NODENAME="n7")
    assert attempts(tmp_path) == 2, err[-3000:]
    got = outcome_fields(tmp_path)
    assert (rc, got["action"], got["failed"]) == (137, "retry", ["n7@0:-", "n7@1:-"]), (rc, got)
    assert "node n7 has failed 2 times without a new checkpoint (the latest complete: none yet): no spare waits in " \
        "this step; the batch script leaves n7 behind where the job can run without it" in got["line"], got
    assert "charged to node n7 (1 of 2 without a new checkpoint (the latest complete: none yet)); restarting" in err


@pytest.mark.slow
def test_two_failures_of_a_node_with_a_new_checkpoint_between_them_are_not_a_bad_node(tmp_path):
    """The regression of issue 46: n7 kills a rank in step 3 (checkpoint step 2 complete), the job trains on, then n7
    kills a rank again in step 9 (checkpoint step 8 complete): two unrelated failures. Before, the second left n7
    behind ("failed 2 times in this training step") and, on a cluster with no other node, the requeued job stayed
    pending for good. A node's failures count only without a new checkpoint between them: both are restarted."""
    plan = {"0": {"1": {"exit": "kill", "ckpt": 2}}, "1": {"0": {"exit": "kill", "ckpt": 8}}, "2": {},
            "steps": {"0": 3, "1": 9}}
    rc, err = launch(tmp_path, plan, SLURMD_NODENAME="n7")
    assert rc == 0 and attempts(tmp_path) == 3, err[-3000:]
    assert "charged to node n7 (1 of 2 without a new checkpoint (the latest complete: step 8))" in err, err[-3000:]
    assert "left behind" not in err, err[-3000:]
    got = outcome_fields(tmp_path)
    assert (got["action"], got["failed"]) == ("done", ["n7@0:2", "n7@1:8"]), got


@pytest.mark.slow
def test_a_python_exception_is_not_charged_to_the_node(tmp_path):
    plan = {"0": {"0": 1}, "1": {"0": 1}, "2": {}, "steps": {"0": 3, "1": 4}}
    rc, err = launch(tmp_path, plan, SLURMD_NODENAME="n7")
    assert rc == 0 and attempts(tmp_path) == 3, err[-3000:]
    assert outcome_fields(tmp_path)["failed"] == [] and "charged" not in err


@pytest.mark.slow
def test_a_transient_failure_names_its_class_and_a_peers_failure_is_not_the_culprit(tmp_path):
    """Rank 1 exits 75 with an I/O error; rank 0 exits 75 as its peer's victim at the same look: the line names rank
    1 and its class, and the failure is charged to the node."""
    plan = {"0": {"1": {"exit": 75, "after": 0.5, "error": {"kind": "io", "line": "OSError: [Errno 5] Input/output"}},
                  "0": {"exit": 75, "peer_gone": 1, "after": 0, "error": {"kind": "peer", "line": "rank 1 failed"}}}}
    rc, err = launch(tmp_path, plan, SLURMD_NODENAME="n7", monitor_interval=2)
    assert rc == 0, err[-3000:]
    assert "rank 1 (exit 75 (an I/O error): OSError: [Errno 5] Input/output) in step 5; charged to node n7" in err, \
        err[-3000:]


@pytest.mark.slow
def test_the_budget_counts_only_restarts_without_progress(tmp_path):
    """--max_restarts 1 and four failures, a new complete checkpoint before each: the job keeps going (before: it
    ended at the second failure, however much it had trained). Without progress, the second failure ends it."""
    plan = {**{str(a): {"0": {"exit": 1, "ckpt": 2 * a}} for a in range(4)}, "4": {},
            "steps": {str(a): a + 1 for a in range(4)}}
    rc, err = launch(tmp_path, plan, max_restarts=1)
    assert rc == 0 and attempts(tmp_path) == 5, err[-3000:]
    assert "restart 4 of the job, 1 of 1 without a new checkpoint" in err, err[-3000:]
    stuck = {**{str(a): {"0": {"exit": 1, "ckpt": 2}} for a in range(3)}, "steps": {"0": 1, "1": 2, "2": 3}}
    (tmp_path / "again").mkdir()
    rc, err = launch(tmp_path / "again", stuck, max_restarts=1)
    assert rc == 1 and attempts(tmp_path / "again") == 2, err[-3000:]
    assert "the job's 1 restart(s) without a new checkpoint are used up" in err


@pytest.mark.slow
def test_a_node_failing_its_health_check_is_not_restarted_on(tmp_path):
    plan = {"0": {"1": "kill"}, "1": {}}
    rc, err = launch(tmp_path, plan, SLURMD_NODENAME="n7",
                     LLAMA_FP8_NODE_CHECK="echo 'GPU 3: not found' >&2; exit 3")
    assert attempts(tmp_path) == 1, err[-3000:]
    got = outcome_fields(tmp_path)
    assert (got["action"], got["exclude"]) == ("retry", ["n7"]), got
    assert "the node check (LLAMA_FP8_NODE_CHECK) failed with exit 3: GPU 3: not found: failed its health check " \
           "before a restart" in got["line"], got
    assert outcome(tmp_path)[1] == "retry"


def test_bad_hang_settings_stop_the_launcher_naming_them(tmp_path):
    rc, err = launch(tmp_path, {"0": {}}, LLAMA_FP8_HANG_FLOOR_S="soon")
    assert rc == 2 and attempts(tmp_path) == 0, err[-2000:]
    assert "LLAMA_FP8_HANG_FLOOR_S='soon': must be a number of seconds > 0" in err


TRAIN = ["-m", "llama_fp8", "train", "--model", "tiny", "--device", "cpu", "--num_layers", "2",
         "--max_context_width", "32", "--train_batch_size", "2", "--max_steps", "8", "--checkpoint_freq", "2",
         "--logging_freq", "1", "--seed", "3", "--lr_decay_iters", "8"]


def train(tmp_path, name: str, fault: str | None = None, **env) -> subprocess.CompletedProcess:
    """2 ranks of real training under `llama-fp8 launch --standalone`, the default timeouts."""
    cmd = [sys.executable, "-m", "llama_fp8", "launch", "--standalone", "--nproc_per_node=2", "--max_restarts=3",
           *TRAIN, "--run_dir", str(tmp_path / name)]
    extra = {"LLAMA_FP8_FAULT": fault, "LLAMA_FP8_FAULT_DIR": str(tmp_path)} if fault else {}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600, env=cli_env(**extra, **env))


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_records(run)}  # a redone step: its last value


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's losses, once for the module's hang tests (each compares its run with them)."""
    folder = tmp_path_factory.mktemp("hang_ref")
    ref = train(folder, "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    return losses(folder / "ref")


@pytest.mark.slow  # waits out the hang bound (15 s) and a restart: make test runs it, test-fast does not
def test_real_training_a_stopped_rank_is_named_dumped_and_the_job_completes(tmp_path, reference):
    """Rank 1 SIGSTOPped in the middle of step 5, the default --process_group_timeout (600 s): the launcher sees
    it stall within its bound (15 s here), names it (stopped; rank 0 waits for it in a collective), asks
    every rank for its flight recorder (rank 0 dumps into the run folder's comm_traces; the stopped rank cannot),
    kills both and restarts; the job ends with the uninterrupted run's losses."""
    p = train(tmp_path, "run", "stop@step:step=5:rank=1:once", TORCH_FR_BUFFER_SIZE="2000")
    assert p.returncode == 0, p.stderr[-4000:]
    err = p.stderr
    assert "a hang: rank 1 (" in err and "stopped (SIGSTOP) in step 5" in err, err[-4000:]
    assert "rank(s) 0 wait for it (named: stopped)" in err, err[-4000:]
    assert "flight recorder dumped by 1 of 2 rank(s)" in err, err[-4000:]
    dump = pickle.loads((tmp_path / "run" / "comm_traces" / "rank_0").read_bytes())  # our own worker's dump
    assert dump["entries"] and {e["profiling_name"].split(":")[0] for e in dump["entries"]} == {"gloo"}
    assert "closing signal SIGTERM" not in err and "Timed out" not in err  # no wait for the collective timeout
    assert losses(tmp_path / "run") == reference


@pytest.mark.slow
def test_real_training_every_rank_stopped_at_once_is_detected(tmp_path, reference):
    """Both ranks SIGSTOPped in step 5 (a stall where nobody fails: before, it ran to the time limit): seen the same
    way, nobody named as the culprit, restarted, the uninterrupted run's losses."""
    p = train(tmp_path, "run", "stop@step:step=5:once")
    assert p.returncode == 0, p.stderr[-4000:]
    assert "a hang: every rank stopped moving at the same point" in p.stderr, p.stderr[-4000:]
    assert losses(tmp_path / "run") == reference
