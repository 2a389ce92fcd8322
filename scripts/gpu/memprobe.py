"""What one GPU's memory holds besides a training step's tensors, stage by stage: the terms ``llama_fp8 estimate``
adds to its tracked peak (``llama_fp8.estimate.terms``), measured so they can be calibrated from the record.

    python scripts/gpu/memprobe.py [--size N]       (prints one JSON object, its last line)

Stages (each: the device's used memory, PyTorch's reserved and allocated bytes, nvidia-smi's used MiB): before CUDA,
the CUDA context, cuBLAS (one BF16 matmul: its workspace), TE (one FP8 ``te.Linear`` step), NCCL (one rank's
communicator). Without CUDA: ``{"cuda": false, ...}``, exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from memory import smi_once  # nvidia-smi, read the same way as the runs' sampler

ENV_NAMES = ("CUDA_MODULE_LOADING", "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "PYTORCH_CUDA_ALLOC_CONF",
             "NCCL_BUFFSIZE", "NCCL_NVLS_ENABLE", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN")


def reading(torch, name: str, **extra) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"stage": name, "device_used": total - free, "device_total": total,
            "reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated(),
            "smi_used_mib": smi_once()[0], **extra}


def outside(r: dict) -> int:
    """Bytes in use on the device that PyTorch's allocator does not hold."""
    return r["device_used"] - r["reserved"]


def cublas_stage(torch, size: int) -> dict:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    c = a @ b
    tensors = 3 * a.numel() * a.element_size()
    r = reading(torch, "cublas", workspace_in_allocator=None)
    r["workspace_in_allocator"] = r["allocated"] - tensors
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        before = torch.cuda.memory_allocated()
        clear()
        r["workspace_cleared"] = before - torch.cuda.memory_allocated()
    del a, b, c
    return r


def te_stage(torch, size: int) -> dict:
    """One te.Linear forward+backward under FP8 current scaling; {"stage": "te", "skipped": why} without TE/FP8."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8CurrentScaling
    except ImportError as e:
        return {"stage": "te", "skipped": f"transformer_engine does not import: {e}"}
    if torch.cuda.get_device_capability() < (8, 9):
        return {"stage": "te", "skipped": "this GPU has no FP8"}
    new = hasattr(te, "autocast")
    context = (te.autocast if new else te.fp8_autocast)(
        **{"enabled": True, "recipe" if new else "fp8_recipe": Float8CurrentScaling()})
    layer = te.Linear(size, size, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with context:
        y = layer(x)
    y.float().square().mean().backward()
    return reading(torch, "te")


def nccl_stage(torch) -> dict:
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return {"stage": "nccl", "skipped": "this torch has no NCCL"}
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        r = reading(torch, "nccl", nccl=".".join(map(str, torch.cuda.nccl.version())))
    finally:
        dist.destroy_process_group()
    return r


def probe(size: int) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False, "message": "no CUDA device: nothing measured", "torch": torch.__version__}
    out = {"cuda": True, "torch": torch.__version__, "cuda_version": torch.version.cuda, "gpu":
           torch.cuda.get_device_name(), "env": {k: os.environ[k] for k in ENV_NAMES if k in os.environ}}
    stages = [{"stage": "before CUDA", "smi_used_mib": smi_once()[0]}]
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    stages += [reading(torch, "context"), cublas_stage(torch, size), te_stage(torch, size), nccl_stage(torch)]
    return {**out, "stages": stages, "terms": terms(stages)}


def terms(stages: list[dict]) -> dict:
    """The estimate's terms as measured (bytes): context + driver reserve, cuBLAS workspace, what the GEMM
    libraries' code, TE and one NCCL communicator add outside the allocator."""
    by = {s["stage"]: s for s in stages if "device_used" in s}
    out = {}
    if "context" in by:
        out["context_and_driver"] = outside(by["context"])
    if "cublas" in by:
        out["cublas_workspace"] = by["cublas"]["workspace_in_allocator"]
        out["cublas_code_outside"] = outside(by["cublas"]) - outside(by["context"])
    last = by.get("cublas")
    if "te" in by and last is not None:
        out["te_outside"] = outside(by["te"]) - outside(last)
        last = by["te"]
    if "nccl" in by and last is not None:
        out["nccl_one_rank_outside"] = outside(by["nccl"]) - outside(last)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096, help="the matmul's and te.Linear's N (default 4096)")
    args = p.parse_args(argv)
    if args.size < 16 or args.size % 16:
        p.error(f"--size {args.size}: must be a multiple of 16 (FP8 GEMMs need it), at least 16")
    print(json.dumps(probe(args.size), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
