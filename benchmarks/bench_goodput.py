"""Goodput under failures: the same job on two nodes of a local Slurm, fault-free and with a worker SIGKILLed every
T seconds, restarted inside the allocation each time (`1.train_llama.sbatch`, `llama-fp8 launch`).

    .venv/bin/python benchmarks/bench_goodput.py                          # brings a local cluster up and down (root)
    .venv/bin/python benchmarks/bench_goodput.py --cluster_dir /tmp/slurm # a cluster already up (local_cluster.py)

Reports, as ratios of the same run: the faulted job's wall time over the fault-free one's, the restart overhead
(kill -> the next completed step, median and max), the optimizer steps lost per failure (the last step logged
before the kill minus the checkpoint the next attempt resumed from) next to the expected half interval, and the
checkpoint interval that maximizes goodput for the measured save cost (Young/Daly). A table, then one JSON line
``{"bench": "goodput", ...}``.

A kill is sent only once the attempt before it has completed a step: a killer faster than a restart would stop
the job by design (the same point failing twice is not restarted), which is not what this measures.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from llama_fp8.telemetry import goodput  # noqa: E402


def load_local_cluster():
    spec = importlib.util.spec_from_file_location("local_cluster", REPO / "scripts" / "slurm" / "local_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["local_cluster"] = module
    spec.loader.exec_module(module)
    return module


def job_info(job: str, env: dict) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True).stdout
    line = out.splitlines()[0] if out else ""
    return dict(tok.partition("=")[::2] for tok in line.split() if "=" in tok)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def worker_pids(job: str) -> list[int]:
    """The job's training processes (both nodes run on this host)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        # `python -u -m llama_fp8 train` (not the launcher, whose command line ends with the same words)
        if [b"-m", b"llama_fp8", b"train"] in (cmd[1:4], cmd[2:5]) and f"SLURM_JOB_ID={job}".encode() in env:
            pids.append(int(proc.name))
    return pids


def run_job(folder: Path, env: dict, args: list[str], steps: int, every: float | None, max_kills: int,
            seed: int) -> dict:
    """Submit the job; with ``every``, SIGKILL a random worker every ``every`` s once the attempt has completed a
    step. Returns wall time (Slurm's start to end), kill times, the run's records."""
    (folder / "logs").mkdir(parents=True)
    run = folder / "run"
    proc = subprocess.run(["sbatch", "--parsable", "--nodes=2", str(REPO / "1.train_llama.sbatch"), *args,
                           "--run_dir", str(run)], env=env, cwd=folder, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"sbatch failed: {proc.stderr}")
    job, rng, kills = proc.stdout.strip().split(";")[0], random.Random(seed), []
    next_kill = None
    while True:
        info = job_info(job, env)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        train = [r for r in records(run) if r.get("type") == "train" and "time" in r]
        times = [r["time"] for r in train]
        running = train and max(r["step"] for r in train) < steps  # never during the last step's save and exit
        if every and len(kills) < max_kills and running:
            progressed = not kills or max(times) > kills[-1]
            if next_kill is None and progressed:
                next_kill = max(times[0], kills[-1] if kills else 0.0) + every
            if next_kill is not None and time.time() >= next_kill:
                pids = worker_pids(job)
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    kills.append(time.time())
                    next_kill = None
        time.sleep(0.2)
    if info.get("JobState") != "COMPLETED":
        log = folder / "logs" / f"llama-fp8_{job}.out"
        raise SystemExit(f"job {job} ended {info.get('JobState')}:\n{log.read_text()[-3000:] if log.is_file() else ''}")
    fmt = "%Y-%m-%dT%H:%M:%S"
    wall = (datetime.datetime.strptime(info["EndTime"], fmt) - datetime.datetime.strptime(info["StartTime"], fmt))
    return {"job": job, "wall_s": wall.total_seconds(), "kills": kills, "records": records(run)}


def per_failure(recs: list[dict], kills: list[float]) -> list[dict]:
    """For each kill: seconds to the next completed step, and the steps lost: the last step logged before the
    kill minus the step the next attempt resumed from (its first logged step - 1: every step is logged here)."""
    train = [r for r in recs if r.get("type") == "train" and isinstance(r.get("time"), (int, float))]
    out = []
    for t in kills:
        before = [r["step"] for r in train if r["time"] < t]
        after = [r for r in train if r["time"] > t]
        if not after:
            continue
        first = min(after, key=lambda r: r["time"])
        out.append({"restart_s": first["time"] - t, "last_step": max(before, default=0),
                    "resumed_from": first["step"] - 1, "steps_lost": max(before, default=0) - (first["step"] - 1)})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster_dir", help="a local cluster already up (scripts/slurm/local_cluster.py); default: "
                   "bring one up in a temporary folder and down at the end")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--checkpoint_freq", type=int, default=20)
    p.add_argument("--every", type=float, default=20.0, help="seconds between kills (T)")
    p.add_argument("--max_kills", type=int, default=4)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    lc = load_local_cluster()
    own = args.cluster_dir is None
    try:
        cluster = lc.up(tempfile.mkdtemp(prefix="llama-fp8-bench-slurm-"), nodes=2) if own else \
            lc.Cluster.load(args.cluster_dir)
    except lc.ClusterUnavailable as e:  # `make bench` as a user without root: nothing to measure here
        print(f"bench_goodput: skipped: no local Slurm cluster ({e})")
        return 0
    try:
        env = cluster.env()
        env.update(REPO_DIR=str(REPO), VENV=str(Path(sys.executable).parent.parent), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", NPROC_PER_NODE="1", SKIP_PREFLIGHT="1", MAX_RESTARTS="100")
        for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            env.pop(key)
        train = ["--model", "tiny", "--device", "cpu", "--num_layers", str(args.num_layers), "--max_context_width",
                 "32", "--train_batch_size", "2", "--max_steps", str(args.steps), "--checkpoint_freq",
                 str(args.checkpoint_freq), "--logging_freq", "1", "--process_group_timeout", "60"]
        with tempfile.TemporaryDirectory(prefix="llama-fp8-bench-goodput-") as tmp:
            free = run_job(Path(tmp) / "free", env, train, args.steps, None, 0, args.seed)
            hit = run_job(Path(tmp) / "faulted", env, train, args.steps, args.every, args.max_kills, args.seed)
    finally:
        if own:
            lc.down(cluster)

    if not hit["kills"]:
        raise SystemExit(f"no kill happened: training ended within --every {args.every} s; raise --steps")
    fails = per_failure(hit["records"], hit["kills"])
    restart = sorted(f["restart_s"] for f in fails)
    lost = [f["steps_lost"] for f in fails]
    goods = [r for r in free["records"] if r.get("type") == "goodput"]
    saves = -(-args.steps // args.checkpoint_freq)
    save_s = sum(g["checkpoint_sync_s"] + g["checkpoint_async_s"] for g in goods) / saves if goods else None
    step_s = sum(g["productive_s"] for g in goods) / max(args.steps - args.checkpoint_freq, 1) if goods else None
    mtbf = hit["wall_s"] / max(len(hit["kills"]), 1)
    best = goodput.checkpoint_interval(save_s, mtbf) if save_s else None
    ratio = hit["wall_s"] / free["wall_s"]
    print(f"{'run':<10} {'wall s':>8} {'kills':>6} {'restart s (median/max)':>24} {'steps lost/failure':>20}")
    print(f"{'faultfree':<10} {free['wall_s']:>8.0f} {0:>6}")
    print(f"{'faulted':<10} {hit['wall_s']:>8.0f} {len(hit['kills']):>6} "
          f"{(f'{statistics.median(restart):.1f} / {restart[-1]:.1f}' if restart else 'n/a'):>24} "
          f"{(f'{statistics.mean(lost):.2f}' if lost else 'n/a'):>20}")
    print(f"wall faulted / fault-free: {ratio:.2f}x; expected steps lost per failure: {args.checkpoint_freq / 2:.1f} "
          f"(half of --checkpoint_freq {args.checkpoint_freq})")
    if best:
        print(f"save {save_s:.3f} s, step {step_s:.3f} s, one failure per {mtbf:.0f} s: Young/Daly interval "
              f"{best:.1f} s = {best / step_s:.0f} steps")
    print(json.dumps({"bench": "goodput", "ratio": ratio, "wall_faultfree_s": free["wall_s"],
                      "wall_faulted_s": hit["wall_s"], "kills": len(hit["kills"]), "every_s": args.every,
                      "restart_s": restart, "restart_median_s": statistics.median(restart) if restart else None,
                      "restart_max_s": restart[-1] if restart else None, "steps_lost": lost, "failures": fails,
                      "steps_lost_mean": statistics.mean(lost) if lost else None,
                      "steps_lost_expected": args.checkpoint_freq / 2, "checkpoint_freq": args.checkpoint_freq,
                      "steps": args.steps, "save_s": save_s, "step_s": step_s, "mtbf_s": mtbf,
                      "young_daly_interval_s": best}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
