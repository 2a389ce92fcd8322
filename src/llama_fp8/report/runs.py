"""One run of an A/B comparison, loaded from a run dir, a metrics.jsonl, or a plain training log."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llama_fp8.report.logparse import read_log


class CompareError(ValueError):
    """User-facing input error; main() prints it and exits 2."""


@dataclass
class Run:
    """One side of the comparison, normalised to metrics.jsonl record keys."""

    name: str
    source: Path
    kind: str  # "jsonl" | "log"
    train: list[dict[str, Any]]
    val: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    environments: list[dict[str, Any]] = field(default_factory=list)
    """The ``environment`` of every meta record: one per attempt (a requeued run starts again)."""
    goodput: list[dict[str, Any]] = field(default_factory=list)
    """The ``goodput`` record of every attempt (where its wall time went)."""
    restart_gaps: list[float] = field(default_factory=list)
    """Seconds from the last step before each restart to the first step after it (telemetry/goodput.py)."""
    swaps: list[dict[str, Any]] = field(default_factory=list)
    """The ``swap`` records: a spare node that took a training node's place during the run (telemetry/swaps.py)."""


# ----------------------------------------------------------------------------- loading
def _dedupe(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, the last one written wins (a requeued run re-logs steps)."""
    by_step = {int(r["step"]): r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def _read_jsonl(path: Path) -> tuple[list[dict], list[dict], dict, list[dict], list[dict], list[float], list[dict]]:
    from llama_fp8.telemetry.goodput import restart_gaps

    train, val, meta, envs, good, bad, order, swaps = [], [], {}, [], [], 0, [], []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # e.g. a last line cut short when the job was killed
            continue
        kind = rec.get("type") or ("val" if "val_loss" in rec else "train" if "loss" in rec else "")
        if kind in ("meta", "train", "goodput"):
            order.append(rec)
        if kind == "meta":
            meta = meta or rec
            if isinstance(rec.get("environment"), dict) and rec["environment"]:
                envs.append(rec["environment"])
        elif kind == "train" and "step" in rec and "loss" in rec:
            train.append(rec)
        elif kind == "val" and "step" in rec and "val_loss" in rec:
            val.append(rec)
        elif kind == "goodput" and isinstance(rec.get("wall_s"), (int, float)):
            good.append(rec)
        elif kind == "swap" and isinstance(rec.get("failure_to_step_s"), (int, float)):
            swaps.append(rec)
    if bad:
        print(f"compare: warning: skipped {bad} unparsable line(s) in {path}", file=sys.stderr)
    return train, val, meta, envs, good, restart_gaps(order), swaps


def _is_jsonl(path: Path) -> bool:
    if path.suffix == ".jsonl":
        return True
    with path.open(errors="replace") as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def load_run(arg: str, which: str) -> Run:
    """Load RUN_A/RUN_B (``which`` names the argument in errors)."""
    path = Path(arg)
    if not path.exists():
        raise CompareError(f"{which} path does not exist: {path}")
    config: dict[str, Any] = {}
    if path.is_dir():
        metrics = path / "metrics.jsonl"
        if not metrics.is_file():
            raise CompareError(f"{which} is a directory without metrics.jsonl: {path} "
                               "(give a run dir, a metrics.jsonl file or a Slurm log file)")
        config, name, file = _read_config(path / "config.yaml"), path.resolve().name, metrics
    else:
        file = path
        name = path.resolve().parent.name if path.name == "metrics.jsonl" else path.stem
        if path.name == "metrics.jsonl":
            config = _read_config(path.parent / "config.yaml")
    envs: list[dict[str, Any]] = []
    good: list[dict[str, Any]] = []
    gaps: list[float] = []
    swaps: list[dict[str, Any]] = []
    if _is_jsonl(file):
        train, val, meta, envs, good, gaps, swaps = _read_jsonl(file)
        kind = "jsonl"
    else:
        (train, val, meta), kind = read_log(file), "log"
    if not train:
        raise CompareError(f"{which}: no training records in {file} (expected metrics.jsonl "
                           "'type: train' records or 'Batch N Loss: x, Speed: y samples/sec, lr: z' lines)")
    run = Run(name, file, kind, _dedupe(train), _dedupe(val), meta, config, environments=envs, goodput=good,
              restart_gaps=gaps, swaps=swaps)
    run.label = precision_label(run)
    return run


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        print(f"compare: warning: cannot parse {path}: {e}", file=sys.stderr)
        return {}
    return data if isinstance(data, dict) else {}


def _find_key(cfg: dict[str, Any], key: str) -> Any:
    """Look up ``key`` at the top level or one level down (flat or sectioned config.yaml)."""
    if key in cfg:
        return cfg[key]
    for sub in cfg.values():
        if isinstance(sub, dict) and key in sub:
            return sub[key]
    return None


def precision_label(run: Run) -> str:
    """meta precision > train record precision > config.yaml's resolved precision > its fp8 fields > the
    run's name."""
    if run.meta.get("precision"):
        return str(run.meta["precision"])
    if run.train and run.train[-1].get("precision"):
        return str(run.train[-1]["precision"])
    resolved = (run.config.get("resolved") or {}).get("precision")
    if isinstance(resolved, dict) and resolved.get("name"):
        return str(resolved["name"])
    fp8 = _find_key(run.config, "fp8")
    if fp8 is not None:
        if not fp8 or str(fp8).lower() in ("0", "false"):
            return "bf16" if str(_find_key(run.config, "bf16")).lower() not in ("0", "false") else "fp32"
        parts = ["fp8"] + [str(v) for v in (_find_key(run.config, "fp8_backend"),
                                           _find_key(run.config, "fp8_recipe")) if v and v != "auto"]
        return "-".join(parts)
    return run.name
