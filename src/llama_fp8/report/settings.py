"""What each run ran with, as its run folder records it: the settings published speed-ups depend on (compile, FP8
all-gather, activation checkpointing), the precision (format, BF16 tail, emulation) and what the run was warned
about at start; and its MFU against its own format's peak. Read from config.yaml (``asked`` / ``resolved``) and the
meta record; None where a run (a plain log, an older version) did not record it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from llama_fp8.report import stats

if TYPE_CHECKING:
    from llama_fp8.report.runs import Run

# The MFU key each format's runs are measured against (telemetry/peaks.py): MXFP8 runs at the FP8 rate
PEAK_KEY = {"bf16": "mfu_vs_bf16_peak", "fp32": "mfu_vs_bf16_peak", "fp8": "mfu_vs_fp8_peak",
            "mxfp8": "mfu_vs_fp8_peak", "nvfp4": "mfu_vs_fp4_peak"}


def _asked(run: Run) -> dict[str, Any]:
    asked = run.config.get("asked")
    return asked if isinstance(asked, dict) else {}


def _precision(run: Run) -> dict[str, Any]:
    resolved = run.config.get("resolved")
    prec = resolved.get("precision") if isinstance(resolved, dict) else None
    return prec if isinstance(prec, dict) else {}


def run_format(run: Run) -> str | None:
    """bf16, fp8, mxfp8 or nvfp4 (None: unknown). Runs of an earlier version recorded no format: FP8 by label."""
    prec = _precision(run)
    if prec.get("backend") == "none" or run.label in ("bf16", "fp32"):
        return "bf16"
    if prec.get("format"):
        return str(prec["format"])
    return "fp8" if str(run.label).startswith("fp8") else None


def settings(run: Run) -> dict[str, Any]:
    asked, prec = _asked(run), _precision(run)
    return {"format": run_format(run), "compile": asked.get("compile"), "all_gather": prec.get("all_gather"),
            "activation_checkpointing": asked.get("activation_checkpointing"),
            "bf16_tail": prec.get("bf16_tail") or None, "emulated": bool(run.meta.get("fp8_emulated")),
            "notes": list(prec.get("notes") or []), "reason": prec.get("reason") or None}


def flag(value: Any) -> str:
    """A setting as the report prints it: on, off, its value, or n/a when not recorded."""
    return "n/a" if value is None else ("on" if value is True or value in (1, "1", "true") else
                                        "off" if value is False or value in (0, "0", "false") else str(value))


def line(s: dict[str, Any]) -> str:
    """``compile on, FP8 all-gather off, activation checkpointing none`` (+ the BF16 tail, emulation)."""
    parts = [f"compile {flag(s['compile'])}", f"FP8 all-gather {flag(s['all_gather'])}",
             f"activation checkpointing {flag(s['activation_checkpointing'])}"]
    if s["bf16_tail"]:
        parts.append(s["bf16_tail"])
    if s["emulated"]:
        parts.append("emulated (no low-precision tensor cores: speed not meaningful)")
    return ", ".join(parts)


def format_mfu(run: Run, warmup: int) -> tuple[float | None, str | None]:
    """(MFU against the run's own format's dense peak over the kept windows, the record key), None when unknown."""
    key = PEAK_KEY.get(run_format(run) or "")
    if key is None or run.meta.get("fp8_emulated"):  # emulated: no FP8 tensor cores ran, no utilization to state
        return None, key
    vals = [float(r[key]) for r in run.train if r["step"] > warmup and r.get(key) is not None]
    return stats.rate(vals), key
