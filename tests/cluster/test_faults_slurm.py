"""Crashes, hangs, transient faults and bad nodes inside a Slurm allocation, for real: `sbatch 1.train_llama.sbatch`
on the local cluster (three slurmd on this host), 2 nodes x 1 CPU rank (2 x 2 where a victim could be misnamed),
the smaller-than-tiny model, 8 steps, a checkpoint every 2, the default timeouts. Each fault is injected into a
running job; the job must end COMPLETED with every step's loss and the final model and optimizer shards bit for bit
those of one uninterrupted job (the shared ``reference``), or, for a deterministic failure, fail once with its
message. Steps lost are observed: the last step logged before the fault minus the checkpoint the job resumed from
(its log line). These are rows of the fault matrix (tests/reliability/matrix.py)."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from slurm_helpers import (
    REPO,
    SMALL,
    assert_completed,
    job_info,
    make_job_env,
    read_jsonl,
    release_requeued,
    sbatch,
    wait_job,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
import faultkit  # noqa: E402 - losses and shard checksums, as the rest of the fault matrix compares them
import matrix  # noqa: E402 - the fault matrix's row recorder lives with the matrix

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STEPS = 8
ARGS = [*SMALL, "--max_steps", str(STEPS), "--checkpoint_freq", "2", "--logging_freq", "1", "--seed", "3",
        "--lr_decay_iters", str(STEPS)]  # the default timeouts: hangs are the launcher's to see


@dataclass
class Job:
    id: str
    env: dict[str, str]
    dir: Path

    @property
    def log(self) -> Path:
        return self.dir / "logs" / f"llama-fp8_{self.id}.out"

    @property
    def run(self) -> Path:
        return self.dir / "run"

    @property
    def faults(self) -> Path:
        return self.dir / "faults"

    def text(self) -> str:
        return self.log.read_text() if self.log.is_file() else ""

    def wait(self, timeout: float = 300, until=None) -> dict[str, str]:
        return wait_job(self.id, self.env, timeout=timeout, until=until)

    def train_times(self) -> list[tuple[int, float]]:
        path = self.run / "metrics.jsonl"
        return [(r["step"], r["time"]) for r in read_jsonl(path) if r["type"] == "train"] if path.is_file() else []


def submit(cluster, folder: Path, *args: str, nproc: int = 1, **env) -> Job:
    """sbatch the training script on two nodes with ``env`` added (faults: LLAMA_FP8_FAULT...)."""
    (folder / "logs").mkdir(parents=True)
    (folder / "faults").mkdir()
    base = make_job_env(cluster)
    env = dict(base, NPROC_PER_NODE=str(nproc), SKIP_PREFLIGHT="1", LLAMA_FP8_FAULT_DIR=str(folder / "faults"), **env)
    job = sbatch(["--nodes=2", str(REPO / "1.train_llama.sbatch"), *ARGS, *args, "--run_dir", str(folder / "run")],
                 env, folder)
    return Job(job, env, folder)


def uninterrupted(cluster, folder: Path, nproc: int = 1, timeout: float = 300) -> faultkit.Reference:
    job = submit(cluster, folder, nproc=nproc)
    info = job.wait(timeout)
    assert_completed(info, job.log)
    return faultkit.Reference(job.run, faultkit.losses(job.run),
                              faultkit.shard_sums(job.run / "checkpoints" / f"step_{STEPS}"),
                              wall_s=wall_seconds(info))


@pytest.fixture
def reference(fault_reference) -> faultkit.Reference:
    """The uninterrupted job every faulted job must end equal to (same layout, same flags): the session's, which
    test_spares_slurm.py's jobs are compared with too (tests/cluster/conftest.py)."""
    return fault_reference


@pytest.fixture(scope="module")
def reference4(cluster, tmp_path_factory) -> faultkit.Reference:
    """The same on two nodes x two ranks."""
    return uninterrupted(cluster, tmp_path_factory.mktemp("reference4"), nproc=2)


def wall_seconds(info: dict[str, str]) -> float:
    """Slurm's start-to-end time of a job (whole seconds; a requeued job: its last run)."""
    import datetime
    fmt = "%Y-%m-%dT%H:%M:%S"
    return (datetime.datetime.strptime(info["EndTime"], fmt) - datetime.datetime.strptime(info["StartTime"], fmt)
            ).total_seconds()


RESUMED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO llama_fp8\.checkpoint: resumed from \S+/step_(\d+) "
                     r"\(step", re.M)


def resumes(job: Job) -> list[tuple[float, int]]:
    """(when, checkpoint step) of every ``resumed from .../step_N`` line of the job's log (rank 0's logging time)."""
    import datetime
    return [(datetime.datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f").timestamp(), int(step))
            for when, step in RESUMED.findall(job.text())]


def steps_lost(job: Job, since: float) -> int:
    """Observed: the last step logged before ``since`` (a fault) minus the checkpoint the first attempt after the
    fault resumed from (its ``resumed from .../step_N`` line)."""
    before = max((s for s, t in job.train_times() if t < since), default=0)
    after = [step for when, step in resumes(job) if when > since]
    assert after, job.text()[-3000:]
    return before - after[0]


def assert_bitwise(job: Job, ref: faultkit.Reference) -> None:
    """Every step's loss (its last value: a step redone after a restart counts once) and the final model and
    optimizer shards equal the uninterrupted job's."""
    got = faultkit.losses(job.run)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    assert got == ref.losses, (got, ref.losses)
    assert faultkit.shard_sums(job.run / "checkpoints" / f"step_{STEPS}") == ref.final


def fired_at(job: Job, point: str, rank: int, step: int | None = None) -> float:
    """When a ``once`` fault fired (its marker: fired.POINT.rankR, .stepN for a fault bound to a step)."""
    return (job.faults / f"fired.{point}.rank{rank}{'' if step is None else f'.step{step}'}").stat().st_mtime


def steps_lost_all(job: Job, faults: list[float]) -> list[int]:
    """``steps_lost`` for each of several faults."""
    return [steps_lost(job, since) for since in faults]


def back_to_training(job: Job, since: float) -> float:
    """Seconds from ``since`` (a fault) to the first step completed after it (the restarted attempt's)."""
    return min(t for _, t in job.train_times() if t > since) - since


def attempts(job: Job) -> int:
    return sum(r["type"] == "meta" for r in read_jsonl(job.run / "metrics.jsonl"))


def restart_lines(job: Job) -> list[str]:
    return [ln for ln in job.text().splitlines() if "restarting the workers of every node" in ln]


def restarts(job: Job) -> dict[int, list[str]]:
    """Restart number -> the launchers' lines deciding it. One restart can have a line from each node: the node
    of the failed rank, and another whose gloo rank failed on its own before the first node's launcher joined the
    next round (it then decides too, for the same round, instead of following)."""
    out: dict[int, list[str]] = {}
    for line in restart_lines(job):
        m = re.search(r"\(restart (\d+) of the job, ", line)
        assert m, line
        out.setdefault(int(m.group(1)), []).append(line)
    return out


def no_sigterm_wait(job: Job) -> None:
    """The failed attempt's live workers got SIGKILL at once, never torch's SIGTERM and 30 s wait (the hang
    bound is the timeout plus a restart; the measured time goes to the fault matrix, not into an assert)."""
    assert "closing signal SIGTERM" not in job.text(), job.text()[-3000:]


def test_worker_sigkilled_twice_restarts_in_the_job(cluster, reference, tmp_path):
    """(a) SIGKILL of a worker at two random steps (rank 1, then rank 0): two restarts inside the allocation. The
    steps vary from run to run (more of the step/checkpoint phases covered over time); every message names them
    and the seed that drew them."""
    seed = random.randrange(1 << 30)
    first, second = random.Random(seed).sample(range(2, STEPS), 2)
    ctx = f"kills of rank 1 in step {first} and rank 0 in step {second} (seed {seed})"
    job = submit(cluster, tmp_path, LLAMA_FP8_FAULT=f"kill@step:step={first}:rank=1:once;kill@step:step={second}:rank=0:once")
    info = job.wait()
    assert_completed(info, job.log)
    assert info["Restarts"] == "0", f"{ctx}: recovered inside the allocation, not by a requeue"
    decided = restarts(job)
    assert sorted(decided) == [1, 2], f"{ctx}: {decided}\n{job.text()[-3000:]}"
    killed = {k: [ln for ln in lines if "(killed by SIGKILL)" in ln] for k, lines in decided.items()}
    assert all(killed.values()), f"{ctx}: a restart not decided on the killed rank's node: {decided}"
    assert_bitwise(job, reference)
    kills = sorted([fired_at(job, "step", 1, first), fired_at(job, "step", 0, second)])
    back = [back_to_training(job, t) for t in kills]
    matrix.record("test_worker_sigkilled_twice_restarts_in_the_job",
                  f"kills in steps {first} and {second}: 2 restarts in the job, COMPLETED, no requeue; kill -> next "
                  f"step {back[0]:.0f} s and {back[1]:.0f} s; losses of steps 1-{STEPS} and final weights bitwise "
                  f"equal to the uninterrupted run", max(steps_lost_all(job, kills)))


def hang_line(job: Job) -> str:
    """The launcher's line deciding the hang (the first one)."""
    lines = [ln for ln in job.text().splitlines() if "llama-fp8 launch:" in ln and ": a hang: " in ln]
    assert lines, job.text()[-4000:]
    return lines[0].split(": a hang: ", 1)[1]


def test_worker_sigstopped_is_detected_and_restarted(cluster, reference4, tmp_path):
    """(b) rank 1 of 2 x 2 ranks frozen by SIGSTOP in step 5, the default timeouts (600 s): the launchers see it stall
    past its bound (max(5 x its recent step, 15 s)), name it and only it (its node's other rank and the other node's
    ranks wait for it in their collectives: before, every rank blocked in the step was named), kill every rank
    (SIGKILL, which a stopped process cannot ignore) and restart in the job; COMPLETED, bitwise, within a minute or
    two of the fault-free job's wall time. Before: nothing until a collective timed out after 600 s."""
    job = submit(cluster, tmp_path, nproc=2, LLAMA_FP8_FAULT="stop@step:step=5:rank=1:once")
    info = job.wait()
    assert_completed(info, job.log)
    line = hang_line(job)
    assert line.startswith("rank 1 (") and "stopped (SIGSTOP) in step 5" in line, line
    assert "rank(s) 0, 2, 3 wait for it" in line and "rank 0 (" not in line and "rank 2 (" not in line, line
    assert "Timed out" not in job.text() and "did not complete within" not in job.text()
    assert sorted(restarts(job)) == [1] and info["Restarts"] == "0", job.text()[-3000:]
    no_sigterm_wait(job)
    assert_bitwise(job, reference4)
    stop = fired_at(job, "step", 1, 5)
    back, extra = back_to_training(job, stop), wall_seconds(info) - reference4.wall_s
    matrix.record("test_worker_sigstopped_is_detected_and_restarted",
                  f"\"a hang: {line[:150]}...\"; SIGKILL, restart in the job; stop -> next step {back:.0f} s; wall "
                  f"time {extra:+.0f} s against the fault-free job; losses of steps 1-{STEPS} and final weights "
                  f"bitwise equal to the uninterrupted run", steps_lost(job, stop))


def test_every_worker_sigstopped_at_once_is_detected_and_restarted(cluster, reference, tmp_path):
    """Every rank frozen by SIGSTOP in step 5 (a stall where nobody fails, as a file system that stops answering all
    of them): before, nothing saw it and the job ran to its time limit. Seen the same way, nobody named as the
    culprit (nobody is behind), restarted in the job; COMPLETED, bitwise."""
    job = submit(cluster, tmp_path, LLAMA_FP8_FAULT="stop@step:step=5:once")
    info = job.wait()
    assert_completed(info, job.log)
    line = hang_line(job)
    assert line.startswith("every rank stopped moving at the same point"), line
    assert sorted(restarts(job)) == [1] and info["Restarts"] == "0", job.text()[-3000:]
    assert_bitwise(job, reference)
    stop = min(fired_at(job, "step", r, 5) for r in (0, 1))
    back, extra = back_to_training(job, stop), wall_seconds(info) - reference.wall_s
    matrix.record("test_every_worker_sigstopped_at_once_is_detected_and_restarted",
                  f"\"a hang: {line[:120]}...\"; restart in the job; stop -> next step {back:.0f} s; wall time "
                  f"{extra:+.0f} s against the fault-free job; losses of steps 1-{STEPS} and final weights bitwise "
                  f"equal to the uninterrupted run", steps_lost(job, stop))


def test_transient_eio_on_the_checkpoint_read_after_a_crash_is_retried(cluster, reference, tmp_path):
    """Rank 1 SIGKILLed in step 5; the restarted attempt's first read of step_4 fails with EIO (once per rank): the
    read is retried in place, the job resumes and completes, bitwise. Before: exit 2, "a restart would fail the
    same way", the job ended."""
    job = submit(cluster, tmp_path, LLAMA_FP8_FAULT="kill@step:step=5:rank=1:once;eio@checkpoint.read:once")
    info = job.wait()
    assert_completed(info, job.log)
    text = job.text()
    assert "Input/output error (fault injection at checkpoint.read" in text and "retrying" in text, text[-3000:]
    assert "which this job saved" in text  # one verified read of the checkpoint, not a check and then a load
    assert sorted(restarts(job)) == [1] and info["Restarts"] == "0", text[-3000:]
    assert_bitwise(job, reference)
    kill = fired_at(job, "step", 1, 5)
    matrix.record("test_transient_eio_on_the_checkpoint_read_after_a_crash_is_retried",
                  f"restart in the job; the load's EIO retried (\"{next(ln for ln in text.splitlines() if 'retrying' in ln).split(': ', 2)[-1][:110]}...\"); "
                  f"kill -> next step {back_to_training(job, kill):.0f} s; wall time "
                  f"{wall_seconds(info) - reference.wall_s:+.0f} s against the fault-free job; losses of steps "
                  f"1-{STEPS} and final weights bitwise equal to the uninterrupted run", steps_lost(job, kill))


def test_rank_hangs_in_a_collective_on_slurm(cluster, reference, tmp_path):
    """The backstop: the launcher's hang detection off (LLAMA_FP8_HANG_FACTOR=0), a rank stuck outside collectives
    (a sleep loop in step 5, deaf to SIGTERM): rank 0 waits for it in the step's collective, gives up after
    --process_group_timeout (30 s here) naming it, and every rank restarts."""
    job = submit(cluster, tmp_path, "--process_group_timeout", "30", LLAMA_FP8_FAULT="hang@step:step=5:rank=1:once",
                 LLAMA_FP8_HANG_FACTOR="0")
    info = job.wait()
    assert_completed(info, job.log)
    text = job.text()
    assert "Timed out waiting 30000ms" in text and "a hang:" not in text, text[-3000:]
    assert "stopped moving" in text and "in step 5, no progress for" in text, text[-3000:]
    assert sorted(restarts(job)) == [1] and info["Restarts"] == "0", text[-3000:]
    no_sigterm_wait(job)
    assert_bitwise(job, reference)
    hang = fired_at(job, "step", 1, 5)
    matrix.record("test_rank_hangs_in_a_collective_on_slurm",
                  f"rank 0: \"a collective did not complete within --process_group_timeout=30 s (... Timed out waiting "
                  f"30000ms ...)\"; rank 1 named (\"stopped moving ... in step 5\"), killed, restart in the job; hang "
                  f"-> next step {back_to_training(job, hang):.0f} s; losses of steps 1-{STEPS} and final weights "
                  f"bitwise equal to the uninterrupted run", steps_lost(job, hang))


def test_worker_exiting_1_restarts_in_the_job(cluster, reference, tmp_path):
    """(c) a worker exits 1 (an exception) in step 5: every rank restarts and resumes from step_4."""
    job = submit(cluster, tmp_path, LLAMA_FP8_FAULT="raise@step:step=5:rank=0:once")
    info = job.wait()
    assert_completed(info, job.log)
    decided = restarts(job)
    assert sorted(decided) == [1] and any("rank 0 (exit 1: RuntimeError: fault injection" in ln and "in step 5" in ln
                                          for ln in decided[1]), decided
    assert "resumed from" in job.text() and info["Restarts"] == "0"
    assert_bitwise(job, reference)
    matrix.record("test_worker_exiting_1_restarts_in_the_job",
                  f"\"rank 0 (exit 1 ...) in step 5; restarting the workers of every node (restart 1 of the job, 1 "
                  f"of 3 without a new checkpoint)\"; resumed from step_4; losses of steps 1-{STEPS} and final weights "
                  f"bitwise equal to the uninterrupted run", steps_lost(job, fired_at(job, "step", 0, 5)))


def job_pids(job: Job, node_id: int, command: str) -> list[int]:
    """Pids of ``python -m llama_fp8 COMMAND`` (``launch``, ``train``) of the job on node ``node_id`` (both
    nodes are this host)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if [b"-m", b"llama_fp8", command.encode()] in (cmd[1:4], cmd[2:5]) and \
                env.get(b"SLURM_JOB_ID") == job.id.encode() and env.get(b"SLURM_NODEID") == str(node_id).encode():
            pids.append(int(proc.name))
    return pids


def pause_at_step_4(job: Job) -> None:
    """Wait until both ranks of the first attempt hold in step 4 (``PAUSE``): the test acts at a known step
    however fast the machine trains."""
    job.wait(180, until=lambda i: all((job.faults / f"paused.step.rank{r}").exists() for r in (0, 1)))
    assert all((job.faults / f"paused.step.rank{r}").exists() for r in (0, 1)), job.text()[-3000:]


PAUSE = "pause@step:step=4:once"


def test_rendezvous_host_killed_requeues_and_resumes(cluster, reference, tmp_path):
    """(d) the first node's launcher (the rendezvous host) SIGKILLed in step 4: nothing in the allocation can
    restart the job; the batch script requeues it (requeue 1 of MAX_REQUEUES) and the next attempt resumes."""
    job = submit(cluster, tmp_path, LLAMA_FP8_FAULT=PAUSE)
    pause_at_step_4(job)
    (launcher,) = job_pids(job, 0, "launch")
    workers = job_pids(job, 0, "train")
    assert len(workers) == 1, workers
    os.kill(launcher, signal.SIGKILL)
    killed = time.time()
    # The node's processes die with it. (Slurm's cgroup tracking would kill the orphaned worker when the step ends;
    # this cluster tracks processes by parentage, and a worker whose launcher died has no parent in the step.)
    os.kill(workers[0], signal.SIGKILL)
    job.wait(120, until=lambda i: i.get("Restarts") == "1")
    (job.faults / "release").touch()
    release_requeued(job.id, job.env)
    info = job.wait()
    assert_completed(info, job.log)
    text = job.text()
    assert info["Restarts"] == "1" and "requeue 1 of 3 (MAX_REQUEUES)" in text, text[-3000:]
    assert "resumed from" in text
    assert_bitwise(job, reference)
    matrix.record("test_rendezvous_host_killed_requeues_and_resumes",
                  f"the training step ended (\"requeue 1 of 3 (MAX_REQUEUES)\"), the job was requeued and resumed "
                  f"from the latest checkpoint (kill -> next step {back_to_training(job, killed):.0f} s, 2 s of it "
                  f"Slurm's hold of a requeued job as the test shortened it); COMPLETED; losses of steps 1-{STEPS} "
                  f"and final weights bitwise equal to the uninterrupted run", steps_lost(job, killed))


def node_in_service(env: dict[str, str], name: str, timeout: float = 120) -> None:
    """Wait until Slurm has node ``name`` back: IDLE, ALLOCATED or MIXED, responding (no ``*``), no DOWN/DRAIN."""
    deadline, state = time.monotonic() + timeout, "?"
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "-o", "show", "node", name], env=env, capture_output=True, text=True,
                             check=False).stdout
        m = re.search(r"\bState=(\S+)", out)
        state = m.group(1) if m else "?"
        if state in ("IDLE", "ALLOCATED", "MIXED"):
            return
        time.sleep(0.5)
    pytest.fail(f"node {name} not back in service after {timeout:.0f} s: State={state}")


def steps_gone(job_id: str, timeout: float = 90) -> None:
    """Wait until no slurmstepd of job ``job_id`` is left on this host. A node set DOWN here is alive: its step of
    the first run ends only when its paused rank is released, and a requeued run started before that gets the same
    step id on that node, whose cleanup then kills the new run's task there ("n2: task 1: Killed", a second
    requeue; seen in CI). On a node that really failed nothing is left; Slurm's own 120 s hold covers the rest."""
    mark, deadline, left = f"slurmstepd: [{job_id}.".encode(), time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        left = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(mark):
                    left.append(proc.name)
            except OSError:
                continue
        if not left:
            return
        time.sleep(0.5)
    pytest.fail(f"job {job_id}: slurmstepd processes {left} still running after {timeout:.0f} s")


def job_nodes(job: Job) -> list[str]:
    """The job's nodes (this run's), in order."""
    nodes = subprocess.run(["scontrol", "show", "hostnames", job_info(job.id, job.env)["NodeList"]], env=job.env,
                           capture_output=True, text=True, check=True).stdout.split()
    assert len(nodes) == 2, nodes
    return nodes


@pytest.mark.parametrize("which", ["second", "first"])
def test_node_marked_down_is_requeued_by_slurm_and_resumes(cluster, reference, tmp_path, which):
    """(e) a node of the job set DOWN in step 4 (as an admin or a health check does): Slurm kills the job and requeues
    it (NODE_FAIL, --requeue); once the node is back the job resumes from its latest checkpoint. The first node runs
    the batch script too: losing it takes the script with it, and Slurm's requeue is all there is."""
    job = submit(cluster, tmp_path, LLAMA_FP8_FAULT=PAUSE)
    pause_at_step_4(job)
    node = job_nodes(job)[0 if which == "first" else 1]
    scontrol = ["scontrol", "update", f"NodeName={node}"]
    subprocess.run([*scontrol, "State=DOWN", "Reason=llama-fp8 test"], env=job.env, check=True)
    try:
        job.wait(120, until=lambda i: i.get("Restarts") == "1")
    finally:  # back in service: slurmd re-registers it by itself here (ReturnToService=2), then this is refused
        subprocess.run([*scontrol, "State=RESUME"], env=job.env, check=False, capture_output=True)
    node_in_service(job.env, node)  # the requeued job must not start on it before it is (a second NODE_FAIL)
    (job.faults / "release").touch()
    steps_gone(job.id)  # the first run's step on the node (alive here, unlike a failed node) must end before the next
    # Its ranks, released, may finish step 4 and save it before they end (a node that really failed would not):
    # the steps lost are counted from here, against what the requeued run resumed from.
    down = time.time()
    release_requeued(job.id, job.env)
    info = job.wait()
    assert_completed(info, job.log)
    assert info["Restarts"] == "1" and len(resumes(job)) == 1, (info, job.text()[-4000:])  # no restart in the job
    assert_bitwise(job, reference)
    matrix.record(f"test_node_marked_down_is_requeued_by_slurm_and_resumes[{which}]",
                  f"Slurm requeued the job (Restarts=1); after the node's return it resumed from the latest "
                  f"checkpoint; COMPLETED; losses of steps 1-{STEPS} and final weights bitwise equal to the "
                  f"uninterrupted run", steps_lost(job, down))


def test_a_node_that_fails_twice_is_left_behind_on_requeue(cluster, reference, tmp_path):
    """Node n2 kills its rank in step 3, then again in step 4, no new checkpoint between them (a node whose GPU or
    memory fails): the first failure is restarted in the job, the second ends the step (n2 failed twice without
    progress, no spare in the job); the cluster has a node for the job without n2 (n3, idle), so the job is
    requeued without it (held, its ExcNodeList set to n2 by a helper job, released) and completes on n1 and n3,
    resuming from step_2, bitwise. Before: three restarts on n2, then the job failed for good."""
    job = submit(cluster, tmp_path, LLAMA_FP8_FAULT="kill@step:node=n2:step=3:once;kill@step:node=n2:step=4:once")
    job.wait(120, until=lambda i: i.get("JobState") == "RUNNING")
    assert job_nodes(job) == ["n1", "n2"], "an idle cluster places a 2-node job on its first two nodes"
    release_requeued(job.id, job.env)
    info = job.wait()
    assert_completed(info, job.log)
    text = job.text()
    assert "charged to node n2 (1 of 2 without a new checkpoint (the latest complete: step 2)); restarting" in text, \
        text[-4000:]
    assert "node n2 has failed 2 times without a new checkpoint (the latest complete: step 2)" in text, text[-4000:]
    assert "leaving n2 behind: Slurm has 2 node(s) for the requeued job (n1,n3)" in text, text[-4000:]
    assert "requeued without n2 (ExcNodeList=n2" in text, text[-4000:]
    assert info["Restarts"] == "1" and info.get("ExcNodeList") == "n2", info
    assert "n2" not in job_nodes(job), info
    assert_bitwise(job, reference)
    second = fired_at(job, "step", next(r for r in (0, 1) if (job.faults / f"fired.step.rank{r}.step4").exists()), 4)
    matrix.record("test_a_node_that_fails_twice_is_left_behind_on_requeue",
                  f"restart in the job after the first; \"node n2 has failed 2 times without a new checkpoint (the "
                  f"latest complete: step 2)\"; \"leaving n2 behind: Slurm has 2 node(s) for the requeued job "
                  f"(n1,n3)\"; requeued without n2 (ExcNodeList=n2), resumed on {', '.join(job_nodes(job))}; "
                  f"COMPLETED; losses of steps 1-8 and final weights bitwise equal to the uninterrupted run",
                  steps_lost(job, second))


def test_sigusr1_during_a_restart_requeues(cluster, reference, tmp_path):
    """(f) rank 1 killed in step 4; while the workers restart, the time-limit warning (SIGUSR1) reaches the job:
    no new attempt is started (or the new one saves at once), exit 85, the script requeues, the job resumes."""
    job = submit(cluster, tmp_path, LLAMA_FP8_FAULT="kill@step:step=4:rank=1:once")
    deadline = time.monotonic() + 180
    while not restart_lines(job) and time.monotonic() < deadline:  # fast: the new workers take seconds to start
        time.sleep(0.1)
    assert restart_lines(job), job.text()[-3000:]
    subprocess.run(["scancel", "--signal=USR1", job.id], env=job.env, check=True)
    release_requeued(job.id, job.env)
    info = job.wait()
    assert_completed(info, job.log)
    text = job.text()
    assert "received SIGUSR1" in text and "requeueing job" in text and info["Restarts"] == "1", text[-3000:]
    assert_bitwise(job, reference)
    how = next(ln for ln in text.splitlines() if "llama-fp8 launch:" in ln and "SIGUSR1" in ln and
               ("not restarting" in ln or "arrived" in ln))
    matrix.record("test_sigusr1_during_a_restart_requeues",
                  f"\"{how.split(': ', 1)[1][:150]}\"; requeued, resumed; COMPLETED; losses of steps 1-{STEPS} and "
                  f"final weights bitwise equal to the uninterrupted run", steps_lost(job, fired_at(job, "step", 1, 4)))


def test_deterministic_failure_is_not_restarted(cluster, tmp_path):
    """(g) a non-finite loss from step 3 on: exit 3 on every rank, no restart, no requeue, one message."""
    job = submit(cluster, tmp_path, LLAMA_FP8_FAULT_NAN_AT_STEP="3")
    info = job.wait()
    text = job.text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "3:0", "0"), text[-3000:]
    assert "(exit 3 (a non-finite loss)) in step 3: a restart would fail the same way; not restarting, the job " \
        "ends with exit 3; not requeued" in text, text[-3000:]
    assert "not requeued" in text and not restart_lines(job) and attempts(job) == 1
    assert job_info(job.id, job.env).get("Restarts") == "0"
    matrix.record("test_deterministic_failure_is_not_restarted",
                  "FAILED, exit 3, once: \"rank R (exit 3 (a non-finite loss)) in step 3: a restart would fail the "
                  "same way; not restarting, the job ends with exit 3\"; not requeued", None)
