"""Per-layer FP8 numerics (``--fp8_stats N``): every N steps, for every linear layer that runs in FP8, for
its input, weight and output gradient: amax, the scale in use, the share of non-zero elements that
underflow to zero in FP8, the share that reach the format's maximum, and the quantization SNR (dB) of
the FP8 copy against the high-precision tensor.

torchao path: hooks read the tensors ``Float8Linear`` sees (the input of its forward, its weight, the
gradient of its output) and quantize a copy the way its cast config says (dtype, tensorwise or rowwise
scale, power-of-2 rounding): Float8Linear's own math is not touched. One record per layer per logged step
goes to ``{run_dir}/fp8_stats.jsonl`` (rank 0's view); a summary per step goes to metrics.jsonl (and so to
TensorBoard / wandb when they are on). Transformer Engine path: ``models/te/fp8/stats.py`` makes the
same records from TE's debug API.

Block formats (torchao's MXFP8 and NVFP4 layers): each tensor is quantized with torchao's own quantizer (MXFP8:
``MXTensor.to_mx``, 1x32 blocks of E4M3 with E8M0 scales, RCEIL; NVFP4: ``NVFP4Tensor.to_nvfp4``, 1x16 blocks of
E2M1 with E4M3 scales under one per-tensor scale, without the Hadamard transform and the 2-D weight blocks that
torchao's NVFP4 training adds) along its last dimension, as the forward and input-gradient GEMMs see it; the record
adds, per block scale, the share of non-zero blocks whose scale sits at the scale format's smallest value
(``scale_underflow``: the block's small values flush to zero) or could not grow to the block's amax
(``scale_overflow``: the block saturates). ``saturation`` is the share of elements above their block's largest value (MXFP8; None for NVFP4, whose
two-level scale is made from the block's own amax).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

EPS = 1e-12  # as torchao's amax_to_scale: the amax of an all-zero tensor
ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class CastSpec:
    """How one tensor is cast to FP8: its dtype, per-tensor or per-row (last dim) scale, power-of-2 scales."""

    dtype: torch.dtype
    rowwise: bool = False
    pow2: bool = False
    block: str = ""  # "mxfp8" or "nvfp4": torchao's block quantizer (block_stats) instead of a tensor or row scale


def quantize(t: torch.Tensor, spec: CastSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(amax, scale, scaled) of ``t`` in float32: the scale maps amax to the format's max, and ``scaled``
    is ``t * scale`` (before the saturating cast)."""
    fmax = torch.finfo(spec.dtype).max
    x = t.detach().float()
    amax = x.abs().amax(dim=-1, keepdim=True) if spec.rowwise else x.abs().amax()
    scale = fmax / amax.clamp(min=EPS)
    if spec.pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return amax, scale, x * scale


def tensor_stats(t: torch.Tensor, spec: CastSpec) -> dict:
    """amax, scale (the smallest row scale when rowwise), underflow share, saturation share, SNR dB."""
    if spec.block:
        return block_stats(t, spec.block)
    fmax = torch.finfo(spec.dtype).max
    x = t.detach().float()
    amax, scale, scaled = quantize(x, spec)
    deq = scaled.clamp(-fmax, fmax).to(spec.dtype).float() / scale
    nonzero = x != 0
    n_nonzero = int(nonzero.sum())
    signal, noise = float((x * x).sum()), float(((x - deq) ** 2).sum())
    return {"amax": float(amax.max()), "scale": float(scale.min()),
            "underflow": int((nonzero & (deq == 0)).sum()) / n_nonzero if n_nonzero else 0.0,
            "saturation": int((scaled.abs() >= fmax).sum()) / x.numel() if x.numel() else 0.0,
            "snr_db": (10 * math.log10(signal / noise) if noise > 0 else None) if signal > 0 else None}


# Block size, the smallest block scale the quantizer stores (E8M0: 2^-127; torchao clamps NVFP4's E4M3 block scales
# to E4M3's smallest normal, 2^-6), the element format's largest value (E4M3: 448, E2M1: 6)
BLOCKS = {"mxfp8": (32, 2.0 ** -127, 448.0), "nvfp4": (16, torch.finfo(torch.float8_e4m3fn).tiny, 6.0)}


def block_quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dequantized x, each block's stored scale as float32, each block's element scale) by torchao's quantizer;
    ``x`` is 2-D float32 with its last dimension a multiple of the block."""
    if fmt == "mxfp8":
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

        q = MXTensor.to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        scale = q.scale.float().reshape(x.shape[0], -1)
        return q.dequantize(torch.float32), scale, scale
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    tensor_scale = per_tensor_amax_to_scale(x.abs().amax())
    q = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=tensor_scale)
    scale = q.scale.float().reshape(x.shape[0], -1)
    return q.dequantize(torch.float32), scale, scale * tensor_scale


def block_stats(t: torch.Tensor, fmt: str) -> dict:
    """The tensor's statistics in a block format, with the per-block-scale shares (module docstring)."""
    size, smallest, elem_max = BLOCKS[fmt]
    x = t.detach().float().reshape(-1, t.shape[-1]).contiguous()
    deq, stored, elem_scale = block_quantize(x, fmt)
    blocks = x.reshape(x.shape[0], -1, size)
    live = blocks.abs().amax(dim=-1) > 0  # (rows, blocks): blocks with a non-zero value
    n_live = int(live.sum())
    nonzero = x != 0
    n_nonzero = int(nonzero.sum())
    signal, noise = float((x * x).sum()), float(((x - deq) ** 2).sum())
    above = blocks.abs() > (elem_max * elem_scale).unsqueeze(-1) * (1 + 1e-6)  # beyond the block's largest value
    over = int(above.sum()) if fmt == "mxfp8" else None
    return {"amax": float(x.abs().max()) if x.numel() else 0.0,
            "scale": float(elem_scale[live].min()) if n_live else None,
            "underflow": int((nonzero & (deq == 0)).sum()) / n_nonzero if n_nonzero else 0.0,
            "saturation": None if over is None else over / x.numel(),
            "snr_db": (10 * math.log10(signal / noise) if noise > 0 else None) if signal > 0 else None,
            "scale_underflow": int((live & (stored <= smallest)).sum()) / n_live if n_live else 0.0,
            "scale_overflow": int((live & above.any(dim=-1)).sum()) / n_live if n_live else 0.0}


def block_specs(module: nn.Module) -> dict[str, CastSpec]:
    """The casts of a torchao block-format layer (torchao_mx.py): the same block format for every tensor."""
    from llama_fp8.precision import torchao_mx

    fmt = torchao_mx.cast_of(module)
    dtype = torch.float8_e4m3fn if fmt == "mxfp8" else torch.float4_e2m1fn_x2
    return {role: CastSpec(dtype, block=fmt) for role in ROLES}


def torchao_specs(module: nn.Module) -> dict[str, CastSpec]:
    """The cast of input, weight and output gradient a ``Float8Linear`` is configured with."""
    from torchao.float8.config import ScalingGranularity

    cfg = module.config
    pow2 = bool(getattr(cfg, "round_scales_to_power_of_2", False))
    casts = {"input": cfg.cast_config_input, "weight": cfg.cast_config_weight,
             "grad_output": cfg.cast_config_grad_output}
    return {role: CastSpec(c.target_dtype, c.scaling_granularity == ScalingGranularity.AXISWISE, pow2)
            for role, c in casts.items()}


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor behind torchao's weight wrapper or an FSDP DTensor."""
    t = getattr(t, "_tensor", t)
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class TorchaoStats:
    """Hooks on every Float8Linear, active only on the steps being logged (every ``every`` steps)."""

    def __init__(self, every: int):
        self.every, self.active, self.step = every, False, None
        self.records: list[dict] = []
        self._seen: set[tuple[str, str]] = set()
        self._handles = []

    def attach(self, model: nn.Module) -> None:
        from llama_fp8.precision import torchao_mx

        for name, module in model.named_modules():
            if type(module).__name__ == "Float8Linear" or torchao_mx.is_block_linear(module):
                specs = torchao_specs(module) if type(module).__name__ == "Float8Linear" else block_specs(module)
                self._handles.append(module.register_forward_hook(self._forward_hook(name, specs)))

    def _forward_hook(self, name: str, specs: dict[str, CastSpec]):
        def hook(module, args, output):
            if not self.active:
                return
            self._record(name, "input", args[0], specs["input"])
            self._record(name, "weight", _plain(module.weight), specs["weight"])
            if output.requires_grad:
                output.register_hook(lambda g: self._record(name, "grad_output", g, specs["grad_output"]))

        return hook

    def _record(self, layer: str, role: str, t: torch.Tensor, spec: CastSpec) -> None:
        if (layer, role) in self._seen:  # gradient accumulation: the first micro-batch stands for the step
            return
        self._seen.add((layer, role))
        with torch.no_grad():
            dtype = spec.block or str(spec.dtype).removeprefix("torch.")
            self.records.append({"step": self.step, "layer": layer, "tensor": role, "dtype": dtype,
                                 **tensor_stats(_plain(t), spec)})

    def before_step(self, step: int) -> None:
        """Arm the hooks when ``step`` is a logged one."""
        self.step, self.active = step, step % self.every == 0
        self._seen.clear()

    def take(self) -> list[dict]:
        out, self.records, self.active = self.records, [], False
        return out


def summary(records: list[dict], step: int) -> dict:
    """One metrics.jsonl record per logged step: the worst layer by underflow and by SNR per tensor role."""
    rec: dict = {"type": "fp8_stats", "step": step, "layers": len({r["layer"] for r in records})}
    for role in ROLES:
        mine = [r for r in records if r["tensor"] == role]
        if not mine:
            continue
        unders = [r["underflow"] for r in mine if r["underflow"] is not None]
        if unders:  # TE reports none for FP8 primary weights (no high-precision copy to compare)
            rec[f"{role}_underflow_max"] = max(unders)
        snrs = [r["snr_db"] for r in mine if r["snr_db"] is not None]
        if snrs:
            rec[f"{role}_snr_db_min"] = min(snrs)
        for key in ("scale_underflow", "scale_overflow"):  # block formats: per block scale
            shares = [r[key] for r in mine if r.get(key) is not None]
            if shares:
                rec[f"{role}_{key}_max"] = max(shares)
    return rec


def write_records(run_dir: Path, records: list[dict]) -> None:
    with open(run_dir / "fp8_stats.jsonl", "a") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")


def report(stats: TorchaoStats, writer, step: int) -> None:
    """Write what the hooks collected during ``step`` (rank 0: fp8_stats.jsonl and a metrics.jsonl summary),
    then arm them for the next step if it is a logged one."""
    records = stats.take()
    if records and writer.enabled:
        write_records(writer.path.parent, records)
        writer.write(summary(records, step))
    stats.before_step(step + 1)
