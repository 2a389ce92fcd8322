"""How long a training process takes to leave once its command has returned: ``python -m llama_fp8 train`` (which
leaves without the garbage collections of Python's shutdown: ``src/llama_fp8/collector.py``'s ``leave``, its imports
frozen once made) against the same command run through ``main()`` and a plain ``sys.exit``, as another program calls
it (Python's whole shutdown, as before; its start-up is paused alike).

Each round runs the same short single-process training run both ways, in fresh processes, the order alternating.
Measured per process: its wall time, its CPU seconds (user + system, from the kernel's accounting of the child), and
its exit time: from the "Training finished" line on its standard output to the end of the process. Prints a table,
then one JSON line ``{"bench": "exit", ...}`` (its ``ratio``: the median exit time of ``leave`` over the plain
exit's).

Run: ``python benchmarks/bench_exit.py [--rounds 5 --steps 2 --num_layers 2 --model tiny]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLAIN = "import sys\nfrom llama_fp8.__main__ import main\nsys.exit(main(sys.argv[1:]))"  # the exit before `leave`
WAYS = {"leave": ["-m", "llama_fp8"], "plain": ["-c", PLAIN]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="runs of each way (alternating)")
    p.add_argument("--steps", type=int, default=2, help="training steps per run")
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--model", default="tiny", help="a preset (configs/)")
    return p.parse_args(argv)


def one(way: str, args: argparse.Namespace, run_dir: Path) -> dict:
    """One training run in a fresh process: wall, CPU and exit seconds, and its last logged loss."""
    cmd = [sys.executable, *WAYS[way], "train", "--model", args.model, "--device", "cpu", "--num_layers",
           str(args.num_layers), "--max_context_width", "32", "--max_steps", str(args.steps), "--logging_freq", "1",
           "--run_dir", str(run_dir)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    finished, loss = None, None
    for line in p.stdout:
        if line.startswith("Batch "):
            loss = float(line.split("Loss:")[1].split(",")[0])
        if line.startswith("Training finished"):
            finished = time.monotonic()
    _, status, usage = os.wait4(p.pid, 0)
    end = time.monotonic()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0 or finished is None:
        raise SystemExit(f"bench_exit: the {way} run failed (exit {p.returncode}): {' '.join(cmd)}")
    return {"wall_s": end - t0, "cpu_s": usage.ru_utime + usage.ru_stime, "exit_s": end - finished, "loss": loss}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows: dict[str, list[dict]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory(prefix="bench_exit-") as tmp:
        for r in range(args.rounds):
            for way in (("leave", "plain") if r % 2 == 0 else ("plain", "leave")):
                rows[way].append(one(way, args, Path(tmp) / f"{way}{r}"))
    med = {w: {k: statistics.median(x[k] for x in rows[w]) for k in ("wall_s", "cpu_s", "exit_s")} for w in WAYS}
    print(f"leaving a {args.model} ({args.num_layers} layers) training process of {args.steps} steps, {args.rounds} "
          f"rounds, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'way':6s} {'median exit s':>13s} {'median CPU s':>12s} {'median wall s':>13s}")
    for w in WAYS:
        print(f"{w:6s} {med[w]['exit_s']:13.2f} {med[w]['cpu_s']:12.2f} {med[w]['wall_s']:13.2f}")
    ratio = med["leave"]["exit_s"] / max(med["plain"]["exit_s"], 1e-9)
    print(json.dumps({"bench": "exit", "ratio": round(ratio, 4), "model": args.model, "num_layers": args.num_layers,
                      "steps": args.steps, "rounds": args.rounds, "cpus": os.cpu_count(),
                      "load_avg_1min": round(os.getloadavg()[0], 2),
                      "cpu_ratio": round(med["leave"]["cpu_s"] / max(med["plain"]["cpu_s"], 1e-9), 4),
                      "median": {w: {k: round(v, 3) for k, v in m.items()} for w, m in med.items()},
                      "losses": {w: [x["loss"] for x in rows[w]] for w in WAYS}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
