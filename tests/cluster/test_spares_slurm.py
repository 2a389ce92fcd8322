"""Spare nodes and the bad-node policy on the local Slurm (the session's three nodes: two train, one is the spare):
`sbatch --nodes=3 1.train_llama.sbatch` with SPARE_NODES=1, the smaller-than-tiny model, 8 steps, a checkpoint every
2 (test_faults_slurm.py's arguments). Each job must end COMPLETED with every step's loss and the final model and
optimizer shards bit for bit those of one uninterrupted job; what happened in between is read from the job's log,
its metrics.jsonl and Slurm's restart count. Rows of the fault matrix (tests/reliability/matrix.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from slurm_helpers import REPO, assert_completed, make_job_env, read_jsonl, release_requeued, sbatch
from test_faults_slurm import (
    ARGS,
    Job,
    assert_bitwise,
    back_to_training,
    fired_at,
    job_pids,
    matrix,  # the fault matrix's row recorder (tests/reliability), on the path test_faults_slurm put it on
    steps_lost,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
NOT_N3 = 'test "$SLURMD_NODENAME" != n3'  # LLAMA_FP8_NODE_CHECK: n3 fails it (its preflight, its restarts)
NOT_N2 = 'test "$SLURMD_NODENAME" != n2'


@pytest.fixture
def reference(fault_reference):
    """The uninterrupted two-node job the spare jobs must end equal to: test_faults_slurm.py's, made once for
    both files (tests/cluster/conftest.py)."""
    return fault_reference


def submit_spare(cluster, folder: Path, preflight: bool = False, **env) -> Job:
    """sbatch the training script on the three nodes, SPARE_NODES=1 (n1, n2 train; n3 waits)."""
    (folder / "logs").mkdir(parents=True)
    (folder / "faults").mkdir()
    env = dict(make_job_env(cluster), NPROC_PER_NODE="1", SPARE_NODES="1", SKIP_PREFLIGHT="0" if preflight else "1",
               LLAMA_FP8_FAULT_DIR=str(folder / "faults"), **env)
    job = sbatch(["--nodes=3", str(REPO / "1.train_llama.sbatch"), *ARGS, "--run_dir", str(folder / "run")], env,
                 folder)
    return Job(job, env, folder)


def hosts(job: Job) -> list[str]:
    """The training nodes of each attempt, as the launchers told the workers (the meta records)."""
    return [r["environment"]["nodes"] for r in read_jsonl(job.run / "metrics.jsonl") if r["type"] == "meta"]


def swap_records(job: Job) -> list[dict]:
    return [r for r in read_jsonl(job.run / "metrics.jsonl") if r["type"] == "swap"]


def pause_both(job: Job, step: int) -> None:
    paused = [job.faults / f"paused.step.rank{r}" for r in (0, 1)]
    job.wait(1800, until=lambda i: all(p.exists() for p in paused))
    assert all(p.exists() for p in paused), job.text()[-4000:]


def kill_node(job: Job, node_id: int) -> float:
    """SIGKILL the launcher and the worker of the step's node ``node_id`` (its host gone); when."""
    (launcher,) = job_pids(job, node_id, "launch")
    workers = job_pids(job, node_id, "train")
    os.kill(launcher, signal.SIGKILL)
    killed = time.time()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    return killed


def test_failures_far_apart_restart_and_a_bad_node_the_job_cannot_do_without_restarts_in_place(cluster, reference,
                                                                                             tmp_path):
    """Issue 46's scenario, with the preflight: n3 fails it (LLAMA_FP8_NODE_CHECK) and is never used, so the job has
    two nodes and no spare on a cluster with no other node. n2 kills its rank in step 3 and again in step 5, a new
    checkpoint (step 4) between them: restarted both times, not a bad node (before: left behind, and the requeued
    job pending for good). A third kill in step 6, without a new checkpoint since step 5's failure: n2 failed twice
    without progress; the job cannot run without it, so the training step restarts in place on it, saying why."""
    faults = ";".join(f"kill@step:node=n2:step={s}:once" for s in (3, 5, 6))
    job = submit_spare(cluster, tmp_path, preflight=True, LLAMA_FP8_FAULT=faults, LLAMA_FP8_NODE_CHECK=NOT_N3)
    info = job.wait(2400)
    assert_completed(info, job.log)
    text = job.text()
    assert info["Restarts"] == "0", text[-4000:]
    assert "preflight failed on n3: left behind, never used in this job; checking the 2 other node(s) again" in text
    assert "charged to node n2 (1 of 2 without a new checkpoint (the latest complete: step 4)); restarting" in text
    assert "node n2 has failed 2 times without a new checkpoint (the latest complete: step 4): no spare waits" in text
    assert "restarting the training step in place on n2: the job needs 2 node(s); without n2 Slurm could give it " \
           "1 (n1)" in text, text[-4000:]
    assert all("n3" not in nodes for nodes in hosts(job)), hosts(job)
    assert_bitwise(job, reference)
    third = fired_at(job, "step", next(r for r in (0, 1) if (job.faults / f"fired.step.rank{r}.step6").exists()), 6)
    matrix.record("test_failures_far_apart_restart_and_a_bad_node_the_job_cannot_do_without_restarts_in_place",
                  f"n3 failed its preflight: never used; kills in steps 3 and 5 restarted (\"1 of 2 without a new "
                  f"checkpoint\"); the kill in step 6: \"restarting the training step in place on n2: the job needs "
                  f"2 node(s); without n2 Slurm could give it 1 (n1)\"; kill -> next step "
                  f"{back_to_training(job, third):.0f} s; no requeue; COMPLETED; losses of steps 1-8 and final "
                  f"weights bitwise equal to the uninterrupted run", steps_lost(job, third))


def test_a_lost_training_node_continues_on_the_spare_without_a_requeue(cluster, reference, tmp_path):
    """Both ranks hold in step 4; n2's launcher and its worker SIGKILLed (the node gone); released: n1's rank fails
    on the lost peer, torch drops n2 after its heartbeats lapse, and the spare n3 joins the next round. The job
    resumes from step 2 on n1 and n3 without a requeue; the swap is in the log and in metrics.jsonl."""
    job = submit_spare(cluster, tmp_path, LLAMA_FP8_FAULT="pause@step:step=4:once")
    pause_both(job, 4)
    killed = kill_node(job, 1)
    (job.faults / "release").touch()
    info = job.wait(2400)
    assert_completed(info, job.log)
    text = job.text()
    assert info["Restarts"] == "0", text[-4000:]
    assert "node n3: a spare, takes a place (a node stopped answering: round" in text, text[-4000:]
    (swap,) = swap_records(job)
    assert swap["node_in"] == "n3" and 0 < swap["failure_to_step_s"] < 120, swap
    assert "swap: spare n3 took the place of a node" in text and "no requeue; a requeue would have cost" in text
    assert [sorted(n.split(",")) for n in (hosts(job)[0], hosts(job)[-1])] == [["n1", "n2"], ["n1", "n3"]], hosts(job)
    assert_bitwise(job, reference)
    back = back_to_training(job, killed)
    matrix.record("test_a_lost_training_node_continues_on_the_spare_without_a_requeue",
                  f"\"node n3: a spare, takes a place (a node stopped answering ...)\"; trained on {hosts(job)[0]} "
                  f"then {hosts(job)[-1]}; no requeue (Restarts=0); kill -> next step {back:.0f} s (torch's 15 s "
                  f"heartbeat lapse included; the swap record: {swap['failure_to_step_s']:.0f} s); COMPLETED; losses "
                  f"of steps 1-8 and final weights bitwise equal to the uninterrupted run", steps_lost(job, killed))


def test_a_node_failing_its_health_check_goes_to_the_spare_then_a_lost_node_requeues(cluster, reference, tmp_path):
    """n2 kills its rank in step 3 and then fails its health check (LLAMA_FP8_NODE_CHECK): it hands its place to
    the spare n3, no requeue. Later both ranks hold in step 6 and n3's launcher is SIGKILLed: no spare left, so the
    job behaves as without spares: the step ends when the rendezvous gives up on n3 (join_timeout, 30 s here), and
    the job is requeued, without n2 and on two nodes (the cluster has no third for it), and completes."""
    job = submit_spare(cluster, tmp_path, LLAMA_FP8_NODE_CHECK=NOT_N2, PET_RDZV_CONF="join_timeout=30",
                       LLAMA_FP8_FAULT="kill@step:node=n2:step=3:once;pause@step:step=6:once")
    pause_both(job, 6)
    assert "failed its health check before a restart" in job.text(), job.text()[-4000:]
    killed = kill_node(job, 2)
    (job.faults / "release").touch()
    job.wait(1800, until=lambda i: i.get("Restarts") == "1")
    release_requeued(job.id, job.env, timeout=600)
    info = job.wait(2400)
    assert_completed(info, job.log)
    text = job.text()
    assert "failed its health check before a restart; left behind: spare n3 takes its place" in text, text[-4000:]
    assert "no spare was left (SPARE_NODES=1); requeue 1 of 3 (MAX_REQUEUES)" in text, text[-4000:]
    assert "requeued without n2 (ExcNodeList=n2, 2 node(s): n1,n3" in text, text[-4000:]
    assert info["Restarts"] == "1" and info.get("ExcNodeList") == "n2" and info.get("NumNodes") == "2", info
    assert "no spare left (SPARE_NODES=1)" in text
    assert_bitwise(job, reference)
    matrix.record("test_a_node_failing_its_health_check_goes_to_the_spare_then_a_lost_node_requeues",
                  "n2 failed its health check: \"left behind: spare n3 takes its place at the next rendezvous (no "
                  f"requeue)\", trained on {' then '.join(dict.fromkeys(hosts(job)))}; n3 lost with no spare left: "
                  "requeued without n2 on two nodes (ExcNodeList=n2, NumNodes=2); COMPLETED; losses of steps 1-8 and "
                  "final weights bitwise equal to the uninterrupted run", steps_lost(job, killed))
