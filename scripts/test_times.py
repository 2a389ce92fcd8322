#!/usr/bin/env python3
"""The slowest tests and what each spent its time on, from the records of tests/timing.py.

    LLAMA_FP8_TEST_TIMES=times.jsonl .venv/bin/python -m pytest -m "not gpu and not te"
    .venv/bin/python scripts/test_times.py times.jsonl --top 30        # a markdown table, then one JSON line

Columns (seconds): the test's wall time; its CPU time (the test process and the children it waited for; 2 cores
give up to 2 CPU-seconds per second); shared fixtures it set up (the local cluster's start-up, the image builds,
other module/session fixtures such as reference runs); the training attempts it ran (rank 0's own account of
each: imports, the rest of the start-up, training steps, checkpoints, evaluation); and the rest ("other"):
process launch and exit around the runs, torchrun's agent, Slurm's scheduling, the test's own waiting and work.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CLUSTER = {"cluster"}
IMAGES = {"standin_base", "project_image", "small_base", "build_env", "pyxis"}
RUN_PARTS = ("imports", "startup", "training", "checkpoints", "evaluation")


def load(path: Path) -> list[dict]:
    by_id: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        by_id[rec["id"]] = rec  # a rerun of the same test replaces its record
    return list(by_id.values())


def split(rec: dict) -> dict[str, float]:
    fx = rec.get("fixtures", {})
    out = {
        "cluster": sum(v for k, v in fx.items() if k in CLUSTER),
        "images": sum(v for k, v in fx.items() if k in IMAGES),
        "fixtures": sum(v for k, v in fx.items() if k not in CLUSTER | IMAGES),
        "runs": len(rec.get("runs", [])),
    }
    for part in RUN_PARTS:
        out[part] = sum(r.get(part, 0.0) for r in rec.get("runs", []))
    accounted = out["cluster"] + out["images"] + out["fixtures"] + sum(out[p] for p in RUN_PARTS)
    out["other"] = max(rec["wall_s"] - accounted, 0.0)
    return out


def table(records: list[dict], top: int) -> str:
    head = ("| test | wall | CPU | cluster start-up | image builds | other shared fixtures | runs | imports | "
            "rest of start-up | training | checkpoints | evaluation | other |")
    rows = [head, "|" + "---|" * 13]
    for rec in sorted(records, key=lambda r: -r["wall_s"])[:top]:
        s = split(rec)
        cells = [rec["wall_s"], rec["cpu_s"], s["cluster"], s["images"], s["fixtures"]]
        rows.append(f"| `{rec['id']}` | " + " | ".join(f"{c:.0f}" for c in cells) + f" | {s['runs']} | "
                    + " | ".join(f"{s[p]:.0f}" for p in (*RUN_PARTS, "other")) + " |")
    return "\n".join(rows)


def totals(records: list[dict]) -> dict:
    out = {"tests": len(records), "wall_s": round(sum(r["wall_s"] for r in records), 1),
           "cpu_s": round(sum(r["cpu_s"] for r in records), 1)}
    for key in ("cluster", "images", "fixtures", "runs", *RUN_PARTS, "other"):
        out[key] = round(sum(split(r)[key] for r in records), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("times", type=Path, help="the JSONL file tests/timing.py wrote (LLAMA_FP8_TEST_TIMES)")
    ap.add_argument("--top", type=int, default=30, help="how many of the slowest tests to list (default 30)")
    args = ap.parse_args(argv)
    if not args.times.is_file():
        print(f"{args.times}: no such file (run pytest with LLAMA_FP8_TEST_TIMES={args.times})", file=sys.stderr)
        return 2
    records = load(args.times)
    print(table(records, args.top))
    print()
    print(json.dumps({"test_times": totals(records)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
