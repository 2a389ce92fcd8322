"""verify.py's memory steps: what the GPU's memory holds besides tensors (memprobe.py), ``llama_fp8 estimate`` of a
training cell set against the memory its runs measured (the largest reading over the headline's pairs: the
differences its GPU terms stand for, ``llama_fp8.estimate.terms``), and the nvidia-smi sampler the runs are watched
with."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import units
from runs import Context, failure, slug

GIB, MIB = 2**30, 2**20


class SmiSampler:
    """nvidia-smi's used memory of the run's GPU every ``period_ms`` while a command runs: the reading before and the
    sampled peak (a shorter spike can be missed); None without nvidia-smi."""

    def __init__(self, log: Path, period_ms: int = 200):
        self.log, self.period_ms = log, period_ms
        self.proc: subprocess.Popen | None = None
        self.idle: int | None = None

    def __enter__(self) -> SmiSampler:
        self.idle, cmd = smi_once()
        if self.idle is None:
            return self
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen([*cmd, "-lms", str(self.period_ms)], stdout=fh, stderr=subprocess.DEVNULL,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def fields(self) -> dict:
        used = parse(self.log.read_text()) if self.proc is not None and self.log.is_file() else []
        total = parse(self.log.read_text(), column=1) if used else []
        return {"smi_used_idle_mib": self.idle, "smi_used_peak_mib": max(used) if used else None,
                "smi_total_mib": total[-1] if total else None, "smi_samples": len(used)}


def smi_once() -> tuple[int | None, list[str]]:
    """nvidia-smi's used MiB of the run's GPU (None without nvidia-smi) and the query that read it."""
    exe = shutil.which("nvidia-smi")
    index = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    cmd = [exe or "nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits", "-i",
           index if index.isdigit() else "0"]
    try:
        return parse(subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout)[0], cmd
    except (OSError, subprocess.SubprocessError, IndexError):
        return None, cmd


def parse(text: str, column: int = 0) -> list[int]:
    """The MiB numbers of one column of nvidia-smi's csv lines; a line cut off by the sampler's kill left out."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) > column and parts[column].isdigit():
            out.append(int(parts[column]))
    return out


# --- memory/terms ------------------------------------------------------------------------------------------
def run_memory(ctx: Context, unit: units.Unit) -> dict:
    cmd = [ctx.python, str(Path(__file__).with_name("memprobe.py"))]
    out, killed = ctx.run(slug(unit.id), cmd, time.monotonic() + unit.timeout_s)
    base = {"command": shlex.join(cmd)}
    if killed or out.returncode != 0:
        return {**base, **failure(out, killed, "memprobe")}
    found = last_json(out.tail(200_000))
    if found is None:
        return {**base, "status": "failed", "message": "memprobe printed no JSON:\n" + out.tail(1500)}
    if not found.get("cuda"):
        return {**base, "status": "skipped", "message": found.get("message", "no CUDA"), "probe": found}
    return {**base, "status": "passed", "probe": found}


def last_json(text: str) -> dict | None:
    line = next((x for x in reversed(text.splitlines()) if x.startswith("{")), "")
    try:
        return json.loads(line) if line else None
    except json.JSONDecodeError:
        return None


# --- estimate/... --------------------------------------------------------------------------------------------
def estimate_gpu(gpu_name: str) -> str:
    """The estimate's --gpu for the node's GPU (its table: H100, H200, B200, GB200, ...); H100 where the name says
    nothing (``gpus.for_device``: "NVIDIA GB200" is GB200, not B200)."""
    from llama_fp8.estimate import gpus

    return gpus.for_device(gpu_name) or gpus.DEFAULT_GPU


def estimate_cmd(ctx: Context, unit: units.Unit, run_dir: Path) -> list[str]:
    """The cell's own train flags with ``estimate`` in place of ``train``, for one GPU of this node."""
    info = unit.info
    flags = units.train_flags(ctx.opts, info["model"], units.VARIANT[info["variant"]], run_dir,
                              info.get("seed", units.SEED))
    flags[flags.index("--device") + 1] = "cuda"  # an estimate of the GPU run, also in a CPU rehearsal
    return [ctx.python, "-m", "llama_fp8", "estimate", *flags, "--nodes", "1", "--gpus_per_node", "1", "--gpu",
            estimate_gpu(ctx.gpu), "--suggest", "0", "--json"]


def run_estimate(ctx: Context, unit: units.Unit) -> dict:
    run_dir = ctx.work / "runs" / slug(unit.id)
    cmd = estimate_cmd(ctx, unit, run_dir)
    out, killed = ctx.run(slug(unit.id), cmd, time.monotonic() + unit.timeout_s)
    base = {**unit.info, "command": shlex.join(cmd)}
    est = last_json(out.tail(500_000)) if not killed else None
    if killed or est is None or out.returncode not in (0, 4, 5):  # 4, 5: it does not fit (the JSON says so)
        return {**base, **failure(out, killed, "estimate")}
    runs = [r for r in ctx.store.records() if r.get("key") == ctx.key and r.get("gpu") == ctx.gpu
            and r.get("kind") == "train" and r.get("status") == "passed" and not r.get("rehearsal")
            and r.get("unit") in (unit.info["cell"], unit.info["cell"] + "/pair2")]
    return {**base, "status": "passed", "estimate": summary(est), "measured": measured(runs),
            "against": against(est, measured(runs))}


def summary(est: dict) -> dict:
    """The estimate's numbers a calibration needs (bytes)."""
    return {"tracked_peak": est["peak_bytes"], "peak_by_kind": est.get("peak_by_kind"),
            "terms": {t["name"]: t["bytes"] for t in est.get("terms", []) if t.get("added", True)},
            "verdict": est["verdict"]["status"], "needed": est["verdict"]["needed"], "margin": est["verdict"]["margin"],
            "gpu_memory": est["verdict"]["memory"], "stand_in": est.get("stand_in"), "model_impl": est.get("model_impl"),
            "precision": est.get("precision"), "seconds": est.get("seconds")}


def measured(runs: list[dict]) -> dict | None:
    """The largest of each memory reading over the cell's runs (bytes), or None when none ran here."""
    if not runs:
        return None

    def top(key: str, scale: int) -> int | None:
        vals = [r[key] for r in runs if r.get(key) is not None]
        return int(max(vals) * scale) if vals else None

    return {"runs": [r["unit"] for r in runs], "max_allocated": top("mem_peak_gib", GIB),
            "max_reserved": top("mem_reserved_peak_gib", GIB), "smi_used_peak": top("smi_used_peak_mib", MIB),
            "smi_used_idle": top("smi_used_idle_mib", MIB), "alloc_retries": top("alloc_retries", 1)}


def against(est: dict, m: dict | None) -> dict | None:
    """Each term as measured (bytes): tracked peak vs max allocated, reserved - allocated vs the margin, nvidia-smi's
    peak - reserved (context, driver, NCCL) vs those terms, the device's peak vs the whole claim."""
    if m is None or m["max_allocated"] is None:
        return None
    tracked, verdict = est["peak_bytes"], est["verdict"]
    out = {"allocated_minus_tracked": m["max_allocated"] - tracked,
           "allocated_vs_tracked_pct": round(100 * (m["max_allocated"] - tracked) / tracked, 2)}
    if m["max_reserved"] is not None:
        out["reserved_minus_allocated"] = m["max_reserved"] - m["max_allocated"]
        out["margin_claimed"] = verdict["margin"]
    if m["smi_used_peak"] is not None:
        if m["max_reserved"] is not None:
            out["outside_allocator"] = m["smi_used_peak"] - m["max_reserved"]
        out["device_peak_minus_claim"] = m["smi_used_peak"] - verdict["needed"] - verdict["margin"]
    return out
