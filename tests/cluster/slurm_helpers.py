"""Helpers for the launcher tests: the local cluster module, job submission and polling.

The cluster comes from scripts/slurm/local_cluster.py (installs slurm-wlm/munge with apt if missing).
Where that is impossible (not root, no apt) the tests skip with the reason, except in CI (CI=true),
where they fail: the acceptance criterion is that CI runs them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = str(REPO / "1.train_llama.sbatch")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}
# A smaller-than-tiny model: a few seconds per run on two shared cores.
SMALL = ["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
         "--train_batch_size", "2"]


def _load_local_cluster():
    spec = importlib.util.spec_from_file_location("local_cluster", REPO / "scripts" / "slurm" / "local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_cluster"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


local_cluster = _load_local_cluster()


def uses_the_cluster(item) -> bool:
    """The test uses the session's cluster fixture (a test parameter named ``cluster``, as test_swaps.py's, is not
    it)."""
    callspec = getattr(item, "callspec", None)
    return "cluster" in getattr(item, "fixturenames", ()) and (callspec is None or "cluster" not in callspec.params)


def cluster_needed_after(item, nextitem) -> bool:
    """Whether a test after ``item`` in this process may still use the cluster. Under pytest-xdist with
    ``--dist loadgroup`` a worker gets every test of the cluster's group at once (tests/conftest.py puts every test
    that uses it in one group) and knows the next one, so the group's last test is the last to use it; with any other
    distribution nothing is known of the tests still to come. In one process, the session's own order says."""
    if nextitem is not None and uses_the_cluster(nextitem):
        return True
    if hasattr(item.config, "workerinput"):  # xdist's worker: its own "dist" is "no", "loadgroup" the controller's
        return not item.config.getoption("loadgroup", False)
    items = item.session.items
    return any(uses_the_cluster(later) for later in items[items.index(item) + 1:])


def unavailable(reason: str) -> None:
    """Skip with `reason`, or fail in CI where these tests must run."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but the local Slurm cluster (or what its tests need) is unavailable: {reason}")
    pytest.skip(reason)


def startup_path() -> list[str]:
    """tests/startup when the run uses it (tests/conftest.py): the jobs' Python processes read transformers' import
    table from the run's cache as the tests' own do."""
    startup = str(REPO / "tests" / "startup")  # import_cache_env.STARTUP; not imported: this module is also used
    # with only tests/cluster on the path (test_cluster_teardown.py's stand-in session)
    return [startup] if startup in os.environ.get("PYTHONPATH", "").split(os.pathsep) else []


def make_job_env(cluster) -> dict[str, str]:
    """Environment for sbatch/srun clients: cluster conf, repo code, quiet single-threaded torch."""
    env = cluster.env()
    env.update(REPO_DIR=str(REPO), VENV=str(Path(sys.executable).parent.parent), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(REPO / "src"), *startup_path()]))
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def sbatch(args: list[str], env: dict[str, str], cwd: Path) -> str:
    """Submit; return the job id."""
    proc = subprocess.run(["sbatch", "--parsable", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=30, check=False)
    assert proc.returncode == 0, f"sbatch {args} failed: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def job_info(job_id: str, env: dict[str, str]) -> dict[str, str]:
    """`scontrol -o show job ID` as a dict (first line: the job itself)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True,
                         timeout=30, check=False).stdout
    line = out.splitlines()[0] if out else ""
    return dict(tok.partition("=")[::2] for tok in line.split() if "=" in tok)


def wait_job(job_id: str, env: dict[str, str], timeout: float = 180, until=None) -> dict[str, str]:
    """Poll scontrol (not `sbatch --wait`, which polls slowly and reports 0 for cancelled jobs) until the
    job reaches a terminal state, or `until(info)` holds; cancel it and fail on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id, env)
        if (until and until(info)) or info.get("JobState") in TERMINAL:
            return info
        time.sleep(0.5)  # a look costs one scontrol (milliseconds); the tests wait on what it shows
    subprocess.run(["scancel", job_id], env=env, check=False)
    pytest.fail(f"job {job_id} did not finish in {timeout:.0f}s: {job_info(job_id, env)}")


def batch_lines(log: Path) -> list[int]:
    """Step numbers of the `Batch N Loss:` lines in a log."""
    return [int(m) for m in re.findall(r"^Batch (\d+) Loss: [0-9.]+", log.read_text(), flags=re.M)]


def pause_env(faults: Path) -> dict[str, str]:
    """Fault injection that holds every rank in the middle of step 3 of the first attempt (``once``: the
    requeued attempt runs clean) until ``signal_while_paused`` lets it go."""
    faults.mkdir(exist_ok=True)
    return {"LLAMA_FP8_FAULT": "pause@step:step=3:once", "LLAMA_FP8_FAULT_DIR": str(faults)}


def signal_while_paused(job_id: str, env: dict[str, str], faults: Path, ranks: int, log: Path,
                        timeout: float = 180) -> None:
    """Send USR1 to the job's steps while its ``ranks`` ranks are paused (``pause_env``), wait until the log
    says a rank received it, then release them: training stops after step 3 whatever its speed. Sending on a
    `Batch N` line instead raced the training: a small model on a fast machine finished all its steps between
    two looks at the log, and the signal then killed tasks that had already returned (CI failed so once)."""
    paused = [faults / f"paused.step.rank{r}" for r in range(ranks)]
    wait_job(job_id, env, timeout=timeout, until=lambda i: all(p.exists() for p in paused))
    assert all(p.exists() for p in paused), f"job {job_id} ended before its ranks paused at step 3"
    subprocess.run(["scancel", "--signal=USR1", job_id], env=env, check=True)  # the steps' tasks, not the batch shell
    deadline = time.monotonic() + 60
    while "received SIGUSR1" not in (log.read_text() if log.is_file() else "") and time.monotonic() < deadline:
        time.sleep(0.2)
    (faults / "release").touch()
    assert "received SIGUSR1" in log.read_text(), f"no rank of job {job_id} logged the USR1 within 60 s"


def release_requeued(job_id: str, env: dict[str, str], timeout: float = 120) -> dict[str, str]:
    """Wait until the job was requeued (Restarts=1), then shorten Slurm's hold of a requeued job (BeginTime =
    requeue + AuthInfo cred_expire, 120 s) until it starts. The state passes through REQUEUED/COMPLETING before
    PENDING, so release it when it gets there rather than on the first look (the first look missed it once).

    Not to `now` but 2 s later: the kill revoked the job's credential on its node, and slurmd refuses a launch
    credential created in the same second as that revocation ("Job N already killed, do not launch batch job":
    slurm_cred_revoked compares whole seconds). The job then ends FAILED 1:0 without running; that is how this
    test failed once in CI. PENDING means the node finished the kill, so now + 2 s is strictly after it."""
    info = wait_job(job_id, env, until=lambda i: i.get("Restarts") == "1")
    deadline = time.monotonic() + timeout
    released = False  # once: a later `now+2` would push the start back again
    while time.monotonic() < deadline:
        info = job_info(job_id, env)
        state = info.get("JobState")
        if state == "PENDING" and not released:
            update = subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now+2"], env=env,
                                    capture_output=True, text=True, check=False)
            released = update.returncode == 0
        elif state not in ("PENDING", "REQUEUED", "COMPLETING", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING"):
            return info  # running again, or already ended
        time.sleep(1)
    return info


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_completed(info: dict[str, str], log: Path) -> None:
    """The job ended COMPLETED with exit 0:0; otherwise fail showing the end of its log."""
    tail = log.read_text()[-4000:] if log.is_file() else "(no log)"
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), f"{info}\n--- log:\n{tail}"
