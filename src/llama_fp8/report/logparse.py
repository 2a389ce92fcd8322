"""Plain training logs -> metrics.jsonl-shaped records, for ``compare`` on logs of any recipe.

Understood: ``Batch N Loss: x, Speed: y samples/sec, lr: z[, key: value ...]`` lines (ours and the
AWS FSDP recipe's), validation lines ("Validation loss at step N: x" or "Batch N Validation loss: x"),
and train.py's start-up line naming the precision.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_NUM = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|(?i:nan|inf))"
_TRAIN_RE = re.compile(
    rf"Batch\s+(?P<step>\d+)\s+Loss:\s*(?P<loss>{_NUM}),\s*Speed:\s*(?P<speed>{_NUM})\s*"
    rf"samples/sec,\s*lr:\s*(?P<lr>{_NUM})(?P<rest>.*)$"
)
# Validation lines: ours ("Validation loss at step 20: 7.1, ...") and the AWS recipe's
# ("Batch 20 Validation loss: 7.1").
_VAL_RES = [
    re.compile(rf"\bval(?:idation)?[ _]loss\s+at\s+(?:step|batch)\s+(?P<step>\d+)\s*[:=]\s*(?P<loss>{_NUM})", re.I),
    re.compile(rf"(?:Batch|step)\s+(?P<step>\d+)\b.*?\bval(?:idation)?[ _]loss\s*[:=]\s*(?P<loss>{_NUM})", re.I),
]
# train.py's start-up line "...; precision fp8-torchao-tensorwise" (stderr, often merged into the log)
_PRECISION_RE = re.compile(r"\bprecision[:=]?\s+(?P<precision>fp8[\w.-]*|bf16|fp16|fp32)\b")
_VALUE_RE = re.compile(rf"^(?P<num>{_NUM})\s*(?P<unit>\S*)")
_MEM_UNITS_GIB = {"": 1.0, "gib": 1.0, "gb": 1e9 / 2**30, "mib": 1 / 1024, "mb": 1e6 / 2**30}


def _extra_field(key: str, value: str) -> tuple[str, float | None] | None:
    """Map one ``key: value`` field of a log line to a record key, or None when unknown."""
    k = key.strip().lower()
    if value.strip().lower() in ("n/a", "na", "none", "null", "-"):
        num, unit = None, ""
    else:
        m = _VALUE_RE.match(value.strip())
        if not m:
            return None
        num, unit = float(m["num"]), m["unit"].lower()
    if "token" in k:
        return ("tokens_per_sec_per_device" if "device" in k or "gpu" in k else "tokens_per_sec"), num
    if "tflops" in k and ("device" in k or "gpu" in k):
        return "tflops_per_device", num
    if "mfu" in k:
        # ours prints "MFU(bf16 peak)" always and "MFU(fp8 peak)" for FP8 runs; other recipes a plain "MFU".
        name = "mfu_vs_fp8_peak" if "fp8" in k else "mfu_vs_bf16_peak"
        return name, (num / 100 if num is not None and unit == "%" else num)
    if k in ("mem", "memory", "mem_peak", "peak_mem", "max_mem"):
        if unit not in _MEM_UNITS_GIB:
            return None
        return "mem_peak_gib", (num * _MEM_UNITS_GIB[unit] if num is not None else None)
    return None


def parse_log_line(line: str) -> dict[str, Any] | None:
    """Parse a ``Batch N Loss: ...`` (train) or validation-loss line; prefixes are ignored.

    Returns a record in the metrics.jsonl schema (``type`` train or val), or None.
    """
    m = _TRAIN_RE.search(line)
    if m:
        rec: dict[str, Any] = {"type": "train", "step": int(m["step"]), "loss": float(m["loss"]),
                               "samples_per_sec": float(m["speed"]), "lr": float(m["lr"])}
        for part in m["rest"].split(","):
            key, sep, value = part.partition(":")
            mapped = _extra_field(key, value) if sep else None
            if mapped:
                rec[mapped[0]] = mapped[1]
        return rec
    for regex in _VAL_RES:
        m = regex.search(line)
        if m:
            return {"type": "val", "step": int(m["step"]), "val_loss": float(m["loss"])}
    return None


def read_log(path: Path) -> tuple[list[dict], list[dict], dict]:
    """Train/val records of a plain log, and a meta dict with the precision if the log names it."""
    train, val, meta = [], [], {}
    for line in path.read_text(errors="replace").splitlines():
        rec = parse_log_line(line)
        if rec is not None:
            (train if rec["type"] == "train" else val).append(rec)
        elif not meta and (m := _PRECISION_RE.search(line)):
            meta = {"precision": m["precision"]}
    return train, val, meta
