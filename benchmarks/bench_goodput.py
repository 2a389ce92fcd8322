"""Goodput under failures: the same job on two nodes of a local Slurm, fault-free and with a worker SIGKILLed every
T seconds, restarted inside the allocation each time (`1.train_llama.sbatch`, `llama-fp8 launch`), each repeated.

    .venv/bin/python benchmarks/bench_goodput.py                          # brings a local cluster up and down (root)
    .venv/bin/python benchmarks/bench_goodput.py --cluster_dir /tmp/slurm # a cluster already up (local_cluster.py)

Reports, over ``--repeats`` fault-free and ``--repeats`` faulted jobs (interleaved, so that the machine's load hits
both alike): the faulted jobs' mean wall time over the fault-free ones', with a 95 % bootstrap interval over the
jobs; per failure, the time from the kill to the next completed step (median, quartiles, min and max) and where it
went (the kill until the new worker process started: detection, SIGKILL, the rendezvous; then the worker's own
start-up parts, as its goodput record has them: imports, process group, plan and checkpoint check, model build,
optimizer and data, checkpoint load, sinks; then the first steps); the optimizer steps lost per failure, observed
in the job's records and log (the last step logged before the kill minus the checkpoint the next attempt's log
says it resumed from), next to the expected half interval; and the checkpoint interval that maximizes goodput
for the measured save cost (Young/Daly). A table, then one JSON line ``{"bench": "goodput", ...}``.

A kill is sent only once the attempt before it has completed a step: a killer faster than a restart would stop
the job by design (the same point failing twice is not restarted), which is not what this measures.

    .venv/bin/python benchmarks/bench_goodput.py --spare                  # a lost node: a spare against a requeue

``--spare`` measures what a spare node saves, on three nodes of the same cluster in one run: per repeat, one job with
``SPARE_NODES=1`` (two training nodes and a spare) and one without (two nodes), in each of which the second
training node is lost (its launcher and worker SIGKILLed, as when its host dies) once training has logged a few
steps. Reported: the time from the loss to the next completed step with the spare (torch drops the lost node after
its heartbeats lapse, the spare joins, every rank resumes) and with a requeue (the training step ends, the job is
requeued and Slurm holds it for ``AuthInfo`` ``cred_expire`` before it starts again, 120 s by default: not shortened
here), their medians and the ratio, and that the spare job was never requeued. One JSON line ``{"bench":
"goodput_spare", ...}``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import random
import re
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

RESUMED = re.compile(r"resumed from \S+/step_(\d+) \(step")


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
    step. Returns wall time (Slurm's start to end), kill times, the run's records and the job's log."""
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
    log = folder / "logs" / f"llama-fp8_{job}.out"
    text = log.read_text() if log.is_file() else ""
    if info.get("JobState") != "COMPLETED":
        raise SystemExit(f"job {job} ended {info.get('JobState')}:\n{text[-3000:]}")
    fmt = "%Y-%m-%dT%H:%M:%S"
    wall = (datetime.datetime.strptime(info["EndTime"], fmt) - datetime.datetime.strptime(info["StartTime"], fmt))
    return {"job": job, "wall_s": wall.total_seconds(), "kills": kills, "records": records(run), "log": text}


def per_failure(recs: list[dict], kills: list[float], log: str) -> list[dict]:
    """For each kill (in time order): seconds to the next completed step, where they went, and the steps lost:
    the last step logged before the kill minus the step the next attempt started after, as its goodput record says
    (0: no checkpoint yet, it started over); without that record, the log's ``resumed from .../step_N`` lines (one
    per resumed attempt, in order)."""
    train = [r for r in recs if r.get("type") == "train" and isinstance(r.get("time"), (int, float))]
    starts = [r for r in recs if r.get("type") == "goodput" and isinstance(r.get("process_start"), (int, float))]
    resumed = [int(m) for m in RESUMED.findall(log)]
    out = []
    for i, t in enumerate(kills):
        before = [r["step"] for r in train if r["time"] < t]
        after = [r for r in train if r["time"] > t]
        if not after:
            continue
        first = min(after, key=lambda r: r["time"])
        attempt = next((g for g in starts if t < g["process_start"] < first["time"]), None)
        if attempt is not None and isinstance(attempt.get("start_step"), int):
            resumed_from = attempt["start_step"]
        elif i < len(resumed):
            resumed_from = resumed[i]
        else:
            continue
        rec = {"restart_s": first["time"] - t, "last_step": max(before, default=0), "resumed_from": resumed_from,
               "steps_lost": max(before, default=0) - resumed_from}
        if attempt is not None:
            parts = {k: float(v) for k, v in (attempt.get("startup_parts") or {}).items()}
            loop_began = attempt["process_start"] + float(attempt.get("startup_s") or 0.0)
            rec["parts"] = {"kill_to_new_worker": attempt["process_start"] - t, **parts,
                            "first_steps": first["time"] - loop_began}
        out.append(rec)
    return out


def bootstrap_ratio(hit: list[float], free: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of mean(hit) / mean(free), resampling the jobs of each arm."""
    rng = random.Random(seed)
    ratios = sorted(statistics.fmean(rng.choices(hit, k=len(hit))) / statistics.fmean(rng.choices(free, k=len(free)))
                    for _ in range(rounds))
    return ratios[int(0.025 * rounds)], ratios[int(0.975 * rounds) - 1]


def summarize(free: list[dict], hit: list[dict], checkpoint_freq: int, steps: int) -> dict:
    fails = [f for run in hit for f in per_failure(run["records"], run["kills"], run["log"])]
    restart = sorted(f["restart_s"] for f in fails)
    lost = [f["steps_lost"] for f in fails]
    walls_free, walls_hit = [r["wall_s"] for r in free], [r["wall_s"] for r in hit]
    ratio = statistics.fmean(walls_hit) / statistics.fmean(walls_free)
    low, high = bootstrap_ratio(walls_hit, walls_free) if len(free) > 1 and len(hit) > 1 else (ratio, ratio)
    parts: dict[str, list[float]] = {}
    for f in fails:
        for k, v in (f.get("parts") or {}).items():
            parts.setdefault(k, []).append(v)
    goods = [g for run in free for g in run["records"] if g.get("type") == "goodput"]
    saves = sum(g.get("saves") or 0 for g in goods)
    save_s = sum(g["checkpoint_sync_s"] + g["checkpoint_async_s"] for g in goods) / saves if saves else None
    step_s = (statistics.fmean(g["productive_s"] / max(g["step"] - g["start_step"] - checkpoint_freq, 1)
                               for g in goods) if goods else None)
    kills = sum(len(r["kills"]) for r in hit)
    mtbf = sum(walls_hit) / max(kills, 1)
    quart = statistics.quantiles(restart, n=4) if len(restart) > 1 else restart * 3
    return {"bench": "goodput", "repeats": len(hit), "ratio": ratio, "ratio_ci95": [low, high],
            "wall_faultfree_s": walls_free, "wall_faulted_s": walls_hit, "kills": kills,
            "restart_s": restart, "restart_median_s": statistics.median(restart) if restart else None,
            "restart_quartiles_s": [quart[0], quart[-1]] if restart else None,
            "restart_min_s": restart[0] if restart else None, "restart_max_s": restart[-1] if restart else None,
            "restart_parts_median_s": {k: statistics.median(v) for k, v in parts.items()},
            "steps_lost": lost, "steps_lost_mean": statistics.fmean(lost) if lost else None,
            "steps_lost_expected": checkpoint_freq / 2, "failures": fails, "checkpoint_freq": checkpoint_freq,
            "steps": steps, "save_s": save_s, "step_s": step_s, "mtbf_s": mtbf,
            "young_daly_interval_s": goodput.checkpoint_interval(save_s, mtbf) if save_s else None}


def table(s: dict) -> str:
    lines = [f"{'jobs':<10} {'n':>3} {'wall s (each)':<40}",
             f"{'faultfree':<10} {s['repeats']:>3} {' '.join(f'{w:.0f}' for w in s['wall_faultfree_s']):<40}",
             f"{'faulted':<10} {s['repeats']:>3} {' '.join(f'{w:.0f}' for w in s['wall_faulted_s']):<40}",
             f"wall faulted / fault-free: {s['ratio']:.2f}x (95 % interval {s['ratio_ci95'][0]:.2f}-"
             f"{s['ratio_ci95'][1]:.2f}) for {s['kills']} kills"]
    if s["restart_s"]:
        lines.append(f"kill -> next step: median {s['restart_median_s']:.1f} s, quartiles "
                     f"{s['restart_quartiles_s'][0]:.1f}-{s['restart_quartiles_s'][1]:.1f} s, min "
                     f"{s['restart_min_s']:.1f}, max {s['restart_max_s']:.1f} ({len(s['restart_s'])} failures)")
        lines.append("  where it went (medians): " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s"
                                                             for k, v in s["restart_parts_median_s"].items()))
        lines.append(f"steps lost per failure (observed): mean {s['steps_lost_mean']:.2f} {s['steps_lost']}; "
                     f"expected {s['steps_lost_expected']:.1f} (half of --checkpoint_freq {s['checkpoint_freq']})")
    if s["young_daly_interval_s"] and s["step_s"]:
        lines.append(f"save {s['save_s']:.3f} s, step {s['step_s']:.3f} s, one failure per {s['mtbf_s']:.0f} s: "
                     f"Young/Daly interval {s['young_daly_interval_s']:.1f} s = "
                     f"{s['young_daly_interval_s'] / s['step_s']:.0f} steps")
    return "\n".join(lines)


def node_pids(job: str, node_id: int) -> list[int]:
    """The launcher and training processes of the step's node ``node_id`` (every node runs on this host)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and any(cmd[i:i + 2] == [b"-m", b"llama_fp8"] for i in range(1, 3)) and \
                f"SLURM_JOB_ID={job}".encode() in env and f"SLURM_NODEID={node_id}".encode() in env and \
                (b"launch" in cmd or b"train" in cmd):
            pids.append(int(proc.name))
    return pids


def lose_a_node(folder: Path, env: dict, args: list[str], nodes: int, after_step: int) -> dict:
    """Submit on ``nodes`` nodes; once step ``after_step`` is logged, SIGKILL the second node's launcher and worker;
    the seconds from then to the next completed step, and whether the job was requeued."""
    (folder / "logs").mkdir(parents=True)
    run = folder / "run"
    proc = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", str(REPO / "1.train_llama.sbatch"), *args,
                           "--run_dir", str(run)], env=env, cwd=folder, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"sbatch failed: {proc.stderr}")
    job, killed, info = proc.stdout.strip().split(";")[0], None, {}
    while True:
        info = job_info(job, env)
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        steps = [r["step"] for r in records(run) if r.get("type") == "train"]
        if killed is None and steps and max(steps) >= after_step:
            pids = node_pids(job, 1)
            if pids:
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                killed = time.time()
        time.sleep(0.2)
    if info.get("JobState") != "COMPLETED" or killed is None:
        log = folder / "logs" / f"llama-fp8_{job}.out"
        raise SystemExit(f"job {job} ended {info.get('JobState')} (killed: {killed}):\n"
                         f"{log.read_text()[-3000:] if log.is_file() else ''}")
    after = [r["time"] for r in records(run) if r.get("type") == "train" and r["time"] > killed]
    return {"job": job, "failure_to_step_s": min(after) - killed, "requeued": info.get("Restarts") != "0",
            "swaps": [r for r in records(run) if r.get("type") == "swap"]}


def spare_main(cluster, args) -> int:
    env = cluster.env()
    env.update(REPO_DIR=str(REPO), VENV=str(Path(sys.executable).parent.parent), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", NPROC_PER_NODE="1", SKIP_PREFLIGHT="1")
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key)
    train = ["--model", "tiny", "--device", "cpu", "--num_layers", str(args.num_layers), "--max_context_width", "32",
             "--train_batch_size", "2", "--max_steps", str(args.steps), "--checkpoint_freq", str(args.checkpoint_freq),
             "--logging_freq", "1"]
    spare, requeue = [], []
    with tempfile.TemporaryDirectory(prefix="llama-fp8-bench-spare-") as tmp:
        for i in range(args.repeats):
            spare.append(lose_a_node(Path(tmp) / f"spare{i}", {**env, "SPARE_NODES": "1"}, train, 3, 5))
            requeue.append(lose_a_node(Path(tmp) / f"requeue{i}", env, train, 2, 5))
    if any(r["requeued"] for r in spare) or not all(r["requeued"] for r in requeue):
        raise SystemExit(f"expected no requeue with a spare and one without: {spare} {requeue}")
    a, b = [r["failure_to_step_s"] for r in spare], [r["failure_to_step_s"] for r in requeue]
    out = {"bench": "goodput_spare", "repeats": args.repeats, "spare_s": a, "requeue_s": b,
           "spare_median_s": statistics.median(a), "requeue_median_s": statistics.median(b),
           "ratio": statistics.median(b) / statistics.median(a),
           "swap_records_s": [w["failure_to_step_s"] for r in spare for w in r["swaps"]]}
    print(f"a training node lost, to the next completed step: with a spare {out['spare_median_s']:.1f} s (median of "
          f"{len(a)}: {', '.join(f'{x:.1f}' for x in a)}), with a requeue {out['requeue_median_s']:.1f} s "
          f"({', '.join(f'{x:.1f}' for x in b)}): the requeue costs {out['ratio']:.1f}x the spare")
    print(json.dumps(out))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster_dir", help="a local cluster already up (scripts/slurm/local_cluster.py); default: "
                   "bring one up in a temporary folder and down at the end")
    p.add_argument("--repeats", type=int, default=5, help="fault-free and faulted jobs, each (interleaved)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint_freq", type=int, default=20)
    p.add_argument("--every", type=float, default=20.0, help="seconds between kills (T)")
    p.add_argument("--max_kills", type=int, default=3, help="kills per faulted job")
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spare", action="store_true", help="a lost node: one job with a spare node, one requeued "
                   "(three nodes; --repeats pairs)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")

    lc = load_local_cluster()
    own = args.cluster_dir is None
    try:
        cluster = lc.up(tempfile.mkdtemp(prefix="llama-fp8-bench-slurm-"), nodes=3 if args.spare else 2) if own \
            else lc.Cluster.load(args.cluster_dir)
    except lc.ClusterUnavailable as e:  # `make bench` as a user without root: nothing to measure here
        print(f"bench_goodput: skipped: no local Slurm cluster ({e})")
        return 0
    if args.spare:
        try:
            return spare_main(cluster, args)
        finally:
            if own:
                lc.down(cluster)
    free, hit = [], []
    try:
        env = cluster.env()
        env.update(REPO_DIR=str(REPO), VENV=str(Path(sys.executable).parent.parent), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", NPROC_PER_NODE="1", SKIP_PREFLIGHT="1", MAX_RESTARTS="100")
        for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            env.pop(key)
        train = ["--model", "tiny", "--device", "cpu", "--num_layers", str(args.num_layers), "--max_context_width",
                 "32", "--train_batch_size", "2", "--max_steps", str(args.steps), "--checkpoint_freq",
                 str(args.checkpoint_freq), "--logging_freq", "1"]
        with tempfile.TemporaryDirectory(prefix="llama-fp8-bench-goodput-") as tmp:
            for i in range(args.repeats):  # interleaved: fault-free, faulted, fault-free, ...
                free.append(run_job(Path(tmp) / f"free{i}", env, train, args.steps, None, 0, args.seed + i))
                hit.append(run_job(Path(tmp) / f"faulted{i}", env, train, args.steps, args.every, args.max_kills,
                                   args.seed + i))
    finally:
        if own:
            lc.down(cluster)
    if not any(r["kills"] for r in hit):
        raise SystemExit(f"no kill happened: training ended within --every {args.every} s; raise --steps")
    s = summarize(free, hit, args.checkpoint_freq, args.steps)
    print(table(s))
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
