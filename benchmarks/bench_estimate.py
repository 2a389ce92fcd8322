"""What `llama_fp8 estimate` costs on a machine without a GPU: wall time and peak host memory (RSS) of one estimate
of every preset at several world sizes, each in a fresh process, against the cost of starting that process and
importing what the estimate imports (the baseline, measured in the same run).

Each estimate is ``python -m llama_fp8 estimate --model PRESET --model_impl hf --nodes N --gpus_per_node G --json
--suggest 0`` with the preset's own sequence length and batch (the Hugging Face model, which ``auto``'s TE model is
estimated through anyway; FSDP over every GPU, BF16, no activation checkpointing): G = 1
for one GPU, else 8 GPUs per node. Time and peak RSS come from ``os.wait4`` on the child (its own rusage). The
verdict and the tracked peak are printed too. Prints a table, then one JSON line ``{"bench": "estimate", ...}``
(``ratio``: the most expensive estimate's CPU seconds over the baseline's; CPU time, unlike wall time, does not
grow when other jobs share the machine).

Run: ``python benchmarks/bench_estimate.py`` (every preset at 1, 8, 64 and 512 GPUs: 27 minutes on 2 shared cores);
``--presets tiny --gpus 1,8`` for a quick check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORTS = "import llama_fp8.estimate.cli, llama_fp8.estimate.assess, transformers.models.llama, torchao.float8"


def parse(argv: list[str] | None) -> argparse.Namespace:
    sys.path.insert(0, str(REPO / "src"))
    from llama_fp8.config import available_presets

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default=",".join(available_presets()), help="comma-separated presets (default: all)")
    p.add_argument("--gpus", default="1,8,64,512", help="comma-separated world sizes (default 1,8,64,512)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per estimate")
    args = p.parse_args(argv)
    args.presets = args.presets.split(",")
    args.gpus = [int(g) for g in args.gpus.split(",")]
    if any(g < 1 or (g > 8 and g % 8) for g in args.gpus):
        p.error(f"--gpus: 1..8, or a multiple of 8 (8 GPUs per node); got {args.gpus}")
    return args


def run_child(cmd: list[str], timeout: float) -> tuple[float, float, float, int, str]:
    """(wall seconds, CPU seconds, peak RSS MiB, exit code, stdout) of one child process, from its own rusage
    (os.wait4). CPU seconds (user + system) are what to compare on a machine shared with other jobs."""
    import threading

    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # reaps the child: its own peak RSS, not the maximum over children
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    return time.perf_counter() - t0, cpu, usage.ru_maxrss / 1024, proc.returncode, out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    base_wall, base_cpu, base_rss, code, _ = run_child([sys.executable, "-c", IMPORTS], args.timeout)
    assert code == 0, "the baseline (imports) failed"
    rows = []
    for preset in args.presets:
        for gpus in args.gpus:
            nodes, per_node = (1, gpus) if gpus <= 8 else (gpus // 8, 8)
            cmd = [sys.executable, "-m", "llama_fp8", "estimate", "--model", preset, "--model_impl", "hf", "--nodes",
                   str(nodes), "--gpus_per_node", str(per_node), "--json", "--suggest", "0"]
            wall, cpu, rss, code, out = run_child(cmd, args.timeout)
            rec = {"preset": preset, "gpus": gpus, "seconds": round(wall, 1), "cpu_s": round(cpu, 1),
                   "peak_rss_mib": round(rss), "exit_code": code}
            if code in (0, 4):
                d = json.loads(out)
                rec.update(tracked_gib=round(d["peak_bytes"] / 2**30, 2), verdict=d["verdict"]["status"],
                           seq=d["max_context_width"], batch=d["train_batch_size"])
            rows.append(rec)
            print(f"  {preset:<13} {gpus:>4} GPUs  {wall:7.1f} s  {cpu:7.1f} CPU s  {rss:7.0f} MiB  "
                  f"{rec.get('verdict', code)}",
                  file=sys.stderr, flush=True)
    print(f"{'preset':<13} {'GPUs':>5} {'seq':>6} {'batch':>5} {'wall s':>7} {'CPU s':>7} {'CPU x baseline':>14} "
          f"{'peak RSS MiB':>12} {'tracked GiB':>11}  verdict (H100)")
    for r in rows:
        print(f"{r['preset']:<13} {r['gpus']:>5} {r.get('seq', '-'):>6} {r.get('batch', '-'):>5} {r['seconds']:>7.1f} "
              f"{r['cpu_s']:>7.1f} {r['cpu_s'] / base_cpu:>14.1f} {r['peak_rss_mib']:>12} {r.get('tracked_gib', '-'):>11}  "
              f"{r.get('verdict', 'exit ' + str(r['exit_code']))}")
    print(f"{'baseline':<13} {'-':>5} {'':>6} {'':>5} {base_wall:>7.1f} {base_cpu:>7.1f} {1.0:>14.1f} {base_rss:>12.0f}"
          f"   (start-up + imports)")
    slowest = max(rows, key=lambda r: r["cpu_s"])
    print(json.dumps({"bench": "estimate", "cpus": os.cpu_count(), "load_avg_1min": round(os.getloadavg()[0], 2),
                      "baseline_s": round(base_wall, 1), "baseline_cpu_s": round(base_cpu, 1),
                      "baseline_rss_mib": round(base_rss), "ratio": round(slowest["cpu_s"] / base_cpu, 2),
                      "slowest": slowest,
                      "max_rss_mib": max(r["peak_rss_mib"] for r in rows), "results": rows}))
    return 0 if all(r["exit_code"] in (0, 4) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
