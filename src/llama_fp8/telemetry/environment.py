"""Where and with what a run ran: nodes, GPU model and driver, image, library versions, NCCL network.

``describe()`` goes into the ``meta`` record of metrics.jsonl (train/state.py), and the A/B report puts the
two runs' descriptions side by side and says "not the same hardware" when they differ (report/hardware.py).
Every field is best effort: a value that cannot be read is None, and nothing here raises or starts a
collective (it runs on every rank at start-up, before the first step).

Inputs besides the process itself, set by the launch scripts (scripts/slurm/job_lib.sh):
- ``LLAMA_FP8_IMAGE``, ``LLAMA_FP8_IMAGE_SIZE``, ``LLAMA_FP8_IMAGE_MTIME``, ``LLAMA_FP8_IMAGE_SHA256``: the
  Enroot image file on the host (the container cannot see it) and its digest when scripts/build_image.sh
  recorded one next to it;
- ``LLAMA_FP8_PREFLIGHT``: preflight's JSON report of this job (the NCCL network it saw and its bandwidth);
- ``/opt/llama-fp8/image.json`` inside the image: NGC tag, EFA installer and OFI plugin the image was built with.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
from pathlib import Path
from typing import Any

IMAGE_INFO = Path("/opt/llama-fp8/image.json")
HARDWARE_KEYS = ("nodes", "gpu", "gpu_count", "driver", "cpu", "nvlink_domains")
"""What must match for two runs to count as "the same hardware"."""
SOFTWARE_KEYS = ("image", "image_digest", "torch", "cuda", "nccl", "transformer_engine", "torchao", "nccl_network",
                 "nvlink_used")
IF_BOTH = frozenset({"nvlink_domains", "nvlink_used"})
"""Recorded only where the nodes have multi-node NVLink (preflight's nvlink_domain line), and only by runs since:
compared when both runs have a value."""
# ARM's CPU part numbers (/proc/cpuinfo "CPU part", implementer 0x41: Linux arch/arm64/include/asm/cputype.h);
# aarch64's /proc/cpuinfo has no "model name". Grace is a Neoverse-V2, Graviton2/3/4 are N1/V1/V2.
ARM_PARTS = {"0xd0c": "Neoverse-N1", "0xd40": "Neoverse-V1", "0xd49": "Neoverse-N2", "0xd4f": "Neoverse-V2",
             "0xd84": "Neoverse-V3"}


def _safe(fn, *args) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - a description field must never break a training run
        return None


def _version(*dists: str) -> str | None:
    for name in dists:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def driver_version(proc_file: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel driver's version ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15 ...")."""
    text = Path(proc_file).read_text()
    for token in text.split():
        parts = token.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return token
    return None


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """x86's "model name"; on aarch64 (no model name) "ARM <core> (aarch64)" from the first CPU's implementer/part."""
    fields: dict[str, str] = {}
    for line in Path(cpuinfo).read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "model name":
            return value.strip()
        fields.setdefault(key, value.strip().lower())
    if fields.get("cpu implementer") == "0x41" and "cpu part" in fields:
        return f"ARM {ARM_PARTS.get(fields['cpu part'], 'part ' + fields['cpu part'])} (aarch64)"
    if "cpu implementer" in fields:
        return f"implementer {fields['cpu implementer']} part {fields.get('cpu part', '?')} (aarch64)"
    return platform.processor() or None


def nodes(env: dict[str, str]) -> str:
    """The nodes this attempt trains on: as ``llama-fp8 launch`` names them (``LLAMA_FP8_NODES``, in node-rank
    order: a job with spare nodes trains on part of its allocation, and a swap changes them), else the job's node
    list as Slurm writes it (``p5-[1-4]``), else this host's name."""
    return env.get("LLAMA_FP8_NODES") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or \
        socket.gethostname()


def gpu_fields(device_type: str) -> dict[str, Any]:
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        return {"gpu": None, "gpu_count": 0, "driver": _safe(driver_version)}
    return {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
            "driver": _safe(driver_version)}


def nccl_version() -> str | None:
    import torch

    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def image_fields(env: dict[str, str]) -> dict[str, Any]:
    """The image file (host path, size, mtime, digest) and what the image says about itself."""
    out: dict[str, Any] = {"image": env.get("LLAMA_FP8_IMAGE") or None,
                           "image_digest": env.get("LLAMA_FP8_IMAGE_SHA256") or None}
    if out["image"]:
        out["image_size"] = int(env["LLAMA_FP8_IMAGE_SIZE"]) if env.get("LLAMA_FP8_IMAGE_SIZE") else None
        out["image_mtime"] = env.get("LLAMA_FP8_IMAGE_MTIME") or None
    built = _safe(lambda: json.loads(IMAGE_INFO.read_text()))
    if isinstance(built, dict):
        out["image_build"] = built
    return out


def preflight_fields(env: dict[str, str]) -> dict[str, Any]:
    """The NCCL network and bus bandwidth preflight measured for this job, if it ran."""
    path = env.get("LLAMA_FP8_PREFLIGHT")
    report = _safe(lambda: json.loads(Path(path).read_text())) if path else None
    net = (report or {}).get("network") or {}
    nvlink = net.get("nvlink") or {}
    return {"nccl_network": net.get("network"), "nccl_provider": net.get("provider"),
            "preflight_busbw_gbps": net.get("busbw_gbps"), "preflight_status": net.get("status"),
            "nvlink_domains": len(nvlink["domains"]) if nvlink.get("domains") else None,
            "nvlink_used": nvlink.get("used")}


def describe(device_type: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything above as one flat JSON-serialisable dict."""
    import torch

    env = dict(os.environ if env is None else env)
    count = len(env["LLAMA_FP8_NODES"].split(",")) if env.get("LLAMA_FP8_NODES") else \
        _safe(lambda: int(env["SLURM_JOB_NUM_NODES"]))
    out: dict[str, Any] = {"nodes": nodes(env), "num_nodes": count,
                           "host": env.get("SLURMD_NODENAME") or socket.gethostname(), "cpu": _safe(cpu_model)}
    out.update(_safe(gpu_fields, device_type) or {"gpu": None, "gpu_count": None, "driver": None})
    out.update(torch=torch.__version__, cuda=torch.version.cuda,
               nccl=_safe(nccl_version) if torch.cuda.is_available() else None,
               transformer_engine=_version("transformer_engine", "transformer-engine"),
               torchao=_version("torchao"), python=platform.python_version(),
               nccl_net_requested=env.get("NCCL_NET"), nccl_net_plugin=env.get("NCCL_NET_PLUGIN"))
    out.update(image_fields(env))
    out.update(preflight_fields(env))
    return out


def differences(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...]) -> list[str]:
    """``key: A vs B`` for each key whose values differ (missing on both sides is not a difference, nor, for the
    keys of IF_BOTH, missing on one)."""
    return [f"{k}: {a.get(k)} vs {b.get(k)}" for k in keys if a.get(k) != b.get(k)
            and not (k in IF_BOTH and (a.get(k) is None or b.get(k) is None))]
