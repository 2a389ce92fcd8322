"""The versions block of a GPU node, and the key that names "this kind of GPU with these versions" in results
files.

    python scripts/offline/versions.py [--json PATH]

Prints one block (GPU name, driver, CUDA, compute capability, torch, TE, torchao, transformers, cuDNN,
NCCL, ...). Each probe fails on its own: on a machine without a GPU, or without torch, the block is still
printed, with "no GPU" / "not installed" entries, and the exit code is 0. Package versions come from their
metadata (nothing is imported but torch), so a broken Transformer Engine still shows its version.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import platform
import re
import shutil
import subprocess
import sys

from node_checks import torch_build  # in this folder (standard library only)

NO_GPU = "no GPU"
MISSING = "not installed"
CPU_BUILD = "none (CPU build of torch)"
# (field, label), in print order.
FIELDS = (
    ("gpu", "GPU"), ("gpu_memory", "GPU memory"), ("driver", "driver"), ("cuda", "CUDA (torch)"),
    ("nvcc", "CUDA (nvcc)"), ("capability", "compute capability"), ("torch", "torch"),
    ("transformer_engine", "Transformer Engine"), ("transformer_engine_torch", "TE torch extension"),
    ("torchao", "torchao"), ("transformers", "transformers"), ("cudnn", "cuDNN"), ("nccl", "NCCL"),
    ("python", "Python"),
)
# What a visit resumes on: the GPU architecture and the library versions. Not the GPU's name nor the driver: a
# command that lands on an H200 instead of an H100, or on another driver, goes on with the plan (each record
# names its GPU and driver; measurements are done per GPU, verify.py/runs.py, and compared only on one GPU).
KEY_FIELDS = ("capability", "cuda", "torch", "transformer_engine", "transformer_engine_torch", "torchao", "transformers",
              "cudnn", "nccl")


def package_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return MISSING


def nvidia_smi() -> dict[str, str]:
    """GPU name, driver and memory from nvidia-smi (first GPU), or {} without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [r.split(",") for r in out.strip().splitlines() if r.strip()]
    if not rows or len(rows[0]) < 3:
        return {}
    name, driver, memory = (x.strip() for x in rows[0][:3])
    return {"gpu": name + (f" (x{len(rows)})" if len(rows) > 1 else ""), "driver": driver, "gpu_memory": memory}


def nvcc_version() -> str:
    exe = shutil.which("nvcc")
    if exe is None:
        return MISSING
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"error: {e}"
    m = re.search(r"release ([\d.]+)", out)
    return m.group(1) if m else "unknown"


def torch_versions() -> dict[str, str]:
    """torch, its CUDA, cuDNN and NCCL, and the first GPU as torch sees it. A CPU build of torch (its version.py names
    no CUDA and no ROCm) has none of the last four: read from that file, without torch's import (1-2 s of every
    block a CPU machine prints), the same entries its import gives (``torch_imported``)."""
    build = torch_build()
    if build and not (build["cuda"] or build["hip"] or build["rocm"]):
        return {"torch": build["__version__"], "cuda": CPU_BUILD, "cudnn": "none", "nccl": "none"}
    return torch_imported()


def torch_imported() -> dict[str, str]:
    """``torch_versions`` from torch itself."""
    try:
        import torch
    except ImportError:
        return {"torch": MISSING}
    out = {"torch": torch.__version__, "cuda": torch.version.cuda or CPU_BUILD}
    try:
        v = torch.backends.cudnn.version()
        out["cudnn"] = f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v and v >= 90000 else str(v or "none")
    except Exception as e:  # a probe: any failure is reported, none stops the block
        out["cudnn"] = f"error: {e}"
    try:
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:  # CPU builds of torch have no NCCL
        out["nccl"] = "none"
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            out["capability"] = f"{major}.{minor}"
            out["gpu_torch"] = torch.cuda.get_device_name(0)
    except Exception as e:
        out["capability"] = f"error: {e}"
    return out


def collect() -> dict[str, str]:
    """Every field of FIELDS, as strings."""
    v = {"python": platform.python_version(), "nvcc": nvcc_version(),
         "transformer_engine": package_version("transformer_engine", "transformer-engine"),
         "transformer_engine_torch": package_version("transformer_engine_torch"),
         "torchao": package_version("torchao"), "transformers": package_version("transformers")}
    v.update(torch_versions())
    v.update(nvidia_smi())
    if "gpu" not in v:
        v["gpu"] = v.pop("gpu_torch", NO_GPU)
    v.pop("gpu_torch", None)
    for name in ("driver", "capability", "gpu_memory"):
        v.setdefault(name, NO_GPU if v["gpu"] == NO_GPU else "unknown")
    for name, _ in FIELDS:
        v.setdefault(name, "n/a")
    return v


def key(versions: dict[str, str]) -> str:
    """Short, stable name of this GPU architecture + versions: ``sm90-`` and a hash of KEY_FIELDS."""
    digest = hashlib.sha256(json.dumps([versions.get(k) for k in KEY_FIELDS]).encode()).hexdigest()[:10]
    cap = versions.get("capability", "")
    arch = "sm" + cap.replace(".", "") if re.fullmatch(r"\d+\.\d+", cap) else "nogpu"
    return f"{arch}-{digest}"


def format_block(versions: dict[str, str]) -> str:
    width = max(len(label) for _, label in FIELDS)
    lines = ["== versions"] + [f"{label:<{width}}  {versions.get(name, 'n/a')}" for name, label in FIELDS]
    lines.append(f"{'results key':<{width}}  {key(versions)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the versions (and the key) to this file as JSON")
    args = p.parse_args(argv)
    versions = collect()
    print(format_block(versions), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**versions, "key": key(versions)}, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
