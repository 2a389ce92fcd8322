"""Throughput, TFLOPS, MFU and memory, measured on logging steps only, and the log line. Where the records go (the
line, metrics.jsonl and the optional sinks) is sinks.py's and outputs.py's.

Between logging steps nothing here touches the device: no ``.item()``, no synchronize. On a logging
step the device is synchronized once, so the window [previous log, this log] covers finished work.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
from dataclasses import dataclass

import torch

from llama_fp8.telemetry import peaks

log = logging.getLogger(__name__)

# The peak table and the MFU convention live in peaks.py (one home per fact).
PEAK_TFLOPS = peaks.PEAKS
FLOPS_CONVENTION = peaks.FLOPS_CONVENTION


def peak_table_markdown() -> str:
    """docs/report.md's table of the peaks MFU is measured against."""
    return peaks.table_markdown()


def peak_tflops(device: torch.device, override: float | None = None) -> tuple[str, float | None, float | None]:
    """(device name, dense bf16 peak, dense fp8 peak) for this device; a peak is None when unknown, when
    the name is ambiguous or a MIG slice, and on CPU (see ``peaks.resolve``). ``override`` is --peak_tflops."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bf16, fp8, _ = peaks.resolve(name if device.type == "cuda" else None, override)
    return name, bf16, fp8


def memory_gib(device: torch.device) -> float:
    """High-water mark: CUDA max allocated, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib / 2**20


def cuda_memory_extras(device: torch.device) -> dict:
    """CUDA only: reserved high-water mark and allocator retries (a retry = a cudaMalloc failure that
    forced a cache flush: the sign that memory is nearly full and steps are slowing down)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"mem_reserved_peak_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "alloc_retries": int(stats.get("num_alloc_retries", 0))}


@dataclass
class StepMeter:
    """Accumulates per-step loss on the device and wall time, and turns a logging window into numbers."""

    device: torch.device
    world_size: int
    global_batch: int  # sequences per optimizer step, all ranks
    seq_len: int
    flops_per_token: float
    peak_bf16: float | None
    peak_fp8: float | None
    is_fp8: bool
    peak_fp4: float | None = None
    format: str = ""  # the GEMMs' number format (precision.PrecisionChoice.format): nvfp4 adds MFU vs the FP4 peak
    # FP8 emulated (no FP8 tensor cores: torchao's MXFP8 on a Hopper GPU, any FP8 on CPU): its TFLOPS are real, but a
    # utilization of the GPU's peak would read as if FP8 ran; MFU is left blank and the line says why
    emulated: bool = False

    def __post_init__(self) -> None:
        self._loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        self._steps = 0
        self._data_wait = 0.0
        self._t0 = time.perf_counter()
        self.start = self._t0

    def add_step(self, loss: torch.Tensor, data_wait_s: float) -> None:
        self._loss_sum += loss.detach().float()  # stays on the device: no sync
        self._steps += 1
        self._data_wait += data_wait_s

    def window(self, step: int, lr: float, grad_norm: torch.Tensor | None) -> dict:
        """Close the current window (one sync + one all-reduce) and return the metrics record."""
        from llama_fp8.parallel import all_reduce_mean

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed = max(now - self._t0, 1e-9)
        loss = all_reduce_mean(self._loss_sum / max(self._steps, 1)).item()
        samples = self._steps * self.global_batch
        tokens_per_device = samples * self.seq_len / self.world_size / elapsed
        tflops = tokens_per_device * self.flops_per_token / 1e12
        peak_bf16, peak_fp8, peak_fp4 = (None, None, None) if self.emulated else (
            self.peak_bf16, self.peak_fp8, self.peak_fp4)
        rec = {
            "type": "train", "step": step, "loss": loss, "lr": float(lr),  # a tensor for torchao.optim
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "samples_per_sec": samples / elapsed,
            "samples_per_sec_per_device": samples / elapsed / self.world_size,
            "tokens_per_sec": tokens_per_device * self.world_size,
            "tokens_per_sec_per_device": tokens_per_device,
            "tflops_per_device": tflops,
            "mfu_vs_bf16_peak": tflops / peak_bf16 if peak_bf16 else None,
            "mfu_vs_fp8_peak": tflops / peak_fp8 if (peak_fp8 and self.is_fp8) else None,
            "is_fp8": self.is_fp8,
            **({"mfu_vs_fp4_peak": tflops / peak_fp4 if peak_fp4 else None} if self.format == "nvfp4" else {}),
            **({"fp8_emulated": True} if self.emulated else {}),
            "mem_peak_gib": memory_gib(self.device),
            **cuda_memory_extras(self.device),
            "data_wait_frac": min(self._data_wait / elapsed, 1.0),
            "elapsed_s": now - self.start,
            "time": time.time(),
        }
        self._loss_sum.zero_()
        self._steps, self._data_wait, self._t0 = 0, 0.0, time.perf_counter()
        return rec


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_line(rec: dict) -> str:
    """``Batch N Loss: x, Speed: y samples/sec, lr: z`` (the prefix log monitors match), then extras.
    MFU is always against the dense BF16 peak (``MFU(bf16 peak)``); FP8 runs add ``MFU(fp8 peak)``; an emulated
    run has none (``MFU: n/a (FP8 emulated)``)."""
    mfu = f"MFU(bf16 peak): {_num(rec.get('mfu_vs_bf16_peak'), '.3f')}"
    if rec.get("fp8_emulated"):
        mfu = "MFU: n/a (FP8 emulated)"
    elif rec.get("is_fp8"):
        mfu += f", MFU(fp8 peak): {_num(rec.get('mfu_vs_fp8_peak'), '.3f')}"
    if "mfu_vs_fp4_peak" in rec and not rec.get("fp8_emulated"):
        mfu += f", MFU(fp4 peak): {_num(rec.get('mfu_vs_fp4_peak'), '.3f')}"
    return (f"Batch {rec['step']} Loss: {rec['loss']:.5f}, Speed: {rec['samples_per_sec']:.2f} samples/sec, "
            f"lr: {rec['lr']:.6f}, tokens/s/device: {rec['tokens_per_sec_per_device']:.1f}, "
            f"TFLOPS/device: {_num(rec['tflops_per_device'], '.3f')}, {mfu}, "
            f"mem: {_num(rec['mem_peak_gib'], '.2f')} GiB, grad_norm: {_num(rec['grad_norm'], '.3f')}")


def setup_logging(is_main: bool) -> None:
    """INFO on rank 0, warnings only elsewhere, to stderr (stdout carries the Batch lines)."""
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    # torchao logs missing CUDA kernels and Triton on every CPU import; torch logs a pytree deprecation.
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
