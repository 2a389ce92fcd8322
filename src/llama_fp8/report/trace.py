"""Where the GPU time goes, from a torch.profiler trace in Chrome/Perfetto JSON (``traceEvents``).

GPU work is the complete events (``"ph": "X"``) of category ``kernel``, ``gpu_memcpy`` and ``gpu_memset``;
timestamps and durations are in microseconds. The window is the first GPU event's start to the last one's end.
Each kernel falls in one class, tested in this order (the first match wins):

- communication: NCCL kernels (``ncclDevKernel_AllGather...``, ``ReduceScatter``, ``AllReduce``, ...)
- attention: fused attention (flash, fmha, cuDNN SDPA, TE's fused_attn)
- gemm: matrix products (cuBLAS/cuBLASLt ``sm90_xmma_gemm``/``nvjet``, CUTLASS, ``_scaled_mm``, Triton mm)
- fp8_cast: casts to and from FP8 and their scaling (``cast_transpose``, ``quantize``, ``amax``, ``fp8``,
  ``float8``, ``e4m3``/``e5m2`` outside a GEMM)
- other: everything else (elementwise, norms, optimizer, copies)

Shares are each class's kernel time over the window; ``idle`` is the window minus the union of all GPU
events, so overlapping streams (communication under compute) are not counted twice there, while the class
shares can add up to more than 100 % when streams overlap.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

CLASSES = (
    ("communication", re.compile(r"nccl|all_?gather|reduce_?scatter|all_?reduce", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|wgmma|scaled_mm|_mm_|matmul|splitkreduce|triton_tem_fused_mm",
                        re.I)),
    ("fp8_cast", re.compile(r"cast|quantiz|amax|fp8|float8|e4m3|e5m2", re.I)),
)
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def classify(name: str, category: str = "kernel") -> str:
    if category != "kernel":
        return "memcpy"
    for cls, pattern in CLASSES:
        if pattern.search(name):
            return cls
    return "other"


def load(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    if isinstance(data, list):  # the bare-array form of the Chrome trace format
        data = {"traceEvents": data}
    if "traceEvents" not in data:
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents)")
    return data


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(trace: dict, top: int = 15) -> dict:
    """Top kernels and the time share of each class, and idle, over the GPU window."""
    gpu = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES
           and isinstance(e.get("dur"), (int, float))]
    if not gpu:
        return {"gpu_events": 0, "window_ms": 0.0, "note": "no GPU events in the trace (CUDA activity not recorded?)"}
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    window = end - start
    per_class: dict[str, float] = {}
    kernels: dict[str, dict] = {}
    for e in gpu:
        cls = classify(e.get("name", ""), e["cat"])
        per_class[cls] = per_class.get(cls, 0.0) + e["dur"]
        k = kernels.setdefault(e.get("name", "?"), {"name": e.get("name", "?"), "class": cls, "calls": 0, "us": 0.0})
        k["calls"] += 1
        k["us"] += e["dur"]
    busy = _union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    steps = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    ranked = sorted(kernels.values(), key=lambda k: -k["us"])[:top]
    return {
        "gpu_events": len(gpu), "window_ms": window / 1e3, "busy_ms": busy / 1e3, "profiled_steps": len(steps),
        "share": {**{cls: per_class.get(cls, 0.0) / window for cls in
                     ("gemm", "attention", "fp8_cast", "communication", "memcpy", "other")},
                  "idle": (window - busy) / window},
        "top_kernels": [{"name": k["name"][:120], "class": k["class"], "calls": k["calls"], "ms": k["us"] / 1e3,
                         "share": k["us"] / window} for k in ranked],
    }


def find_traces(run_dir: Path) -> list[Path]:
    """Chrome trace files under a run dir (newest last): *.json / *.json.gz holding traceEvents."""
    found = []
    for path in sorted(run_dir.rglob("*.json*"), key=lambda p: p.stat().st_mtime):
        if not path.name.endswith((".json", ".json.gz")) or path.name == "metrics.jsonl":
            continue
        try:
            load(path)
        except (ValueError, OSError, UnicodeDecodeError, EOFError):
            continue
        found.append(path)
    return found


def format_summary(s: dict) -> str:
    if not s.get("gpu_events"):
        return s.get("note", "no GPU events")
    shares = ", ".join(f"{k} {v:.1%}" for k, v in s["share"].items())
    lines = [f"GPU window {s['window_ms']:.1f} ms over {s['profiled_steps']} profiled steps: {shares}"]
    lines += [f"  {k['ms']:9.2f} ms {k['share']:6.1%} {k['calls']:6d}x  {k['class']:<13} {k['name']}"
              for k in s["top_kernels"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a Chrome trace (.json or .json.gz) or a run dir holding one")
    p.add_argument("--top", type=int, default=15, help="how many kernels to list (default 15)")
    args = p.parse_args(argv)
    path = Path(args.trace)
    if not path.exists():
        print(f"{path}: no such file or folder", file=sys.stderr)
        return 1
    if path.is_dir():
        traces = find_traces(path)
        if not traces:
            print(f"{path}: no Chrome trace found", file=sys.stderr)
            return 1
        path = traces[-1]
    print(format_summary(summarize(load(path), args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
