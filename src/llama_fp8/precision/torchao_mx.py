"""torchao's block formats as module swaps: MXFP8 (``MXFP8Linear``) and NVFP4 (``NVFP4Linear``), both prototypes of
torchao 0.18 (``torchao.prototype.moe_training``) that quantize all three GEMMs of a linear layer dynamically.

- MXFP8: ``MXFP8Linear`` with ``KernelPreference.AUTO`` on compute capability 10.x (Triton and CUDA casts, MXFP8
  GEMMs), ``KernelPreference.EMULATED`` elsewhere: the same quantization in torch ops (1x32 blocks of E4M3 with
  E8M0 scales, RCEIL rounding of the scales) and a GEMM of the dequantized values, so the loss is the format's and
  the speed is meaningless. Its weights stay high precision and FSDP2 all-gathers them so (in BF16).
- NVFP4: ``NVFP4Linear`` runs Triton kernels only (``KernelPreference.TRITON``, SM100): no CPU or Hopper path. Each
  layer has two buffers, the Hadamard transform's sign vector and the stochastic-rounding seed, which ``to_empty``
  leaves as garbage: ``prepare`` draws them from ``--seed``, the same on every rank (torchao's default draws a
  different vector per rank), and a checkpoint carries them.

The swap keeps each layer's weight Parameter (on the meta device, before sharding), so parameter names, the
initialization and checkpoints are those of the BF16 model.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

MXFP8_CLASS, NVFP4_CLASS = "MXFP8Linear", "NVFP4Linear"
CLASSES = {"mxfp8": MXFP8_CLASS, "nvfp4": NVFP4_CLASS}


def convert(model: nn.Module, fmt: str, emulated: bool, keep) -> int:
    """Swap every ``nn.Linear`` that ``keep(module, name)`` accepts for torchao's ``fmt`` layer; returns how many."""
    make = _mxfp8_maker(emulated) if fmt == "mxfp8" else _nvfp4_maker()
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is nn.Linear and keep(child, name):
                setattr(parent, child_name, make(child))
                swapped += 1
    return swapped


def _mxfp8_maker(emulated: bool):
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    preference = KernelPreference.EMULATED if emulated else KernelPreference.AUTO

    def make(linear: nn.Linear) -> nn.Module:
        with torch.device("meta"):
            new = MXFP8Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              kernel_preference=preference, scale_calculation_mode=ScaleCalculationMode.RCEIL)
        new.weight = linear.weight
        if linear.bias is not None:
            new.bias = linear.bias
        return new

    return make


def _nvfp4_maker():
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    def make(linear: nn.Linear) -> nn.Module:
        new = NVFP4Linear.from_linear(linear, kernel_preference=KernelPreference.TRITON)
        new.weight = linear.weight  # from_linear keeps a meta layer's own fresh weight: keep ours (its name, its init)
        if linear.bias is not None:
            new.bias = linear.bias
        return new

    return make


def is_block_linear(module: nn.Module) -> bool:
    return type(module).__name__ in CLASSES.values()


def prepare(model: nn.Module, seed: int) -> int:
    """Fill each NVFP4 layer's buffers, which ``to_empty`` left as garbage: its Hadamard sign vector (16 values of
    +-1) and its stochastic-rounding seed, both drawn from ``seed`` and the layer's name, so that every rank holds
    the same and a rerun the same again. Returns how many layers."""
    n = 0
    for name, module in model.named_modules():
        if type(module).__name__ != NVFP4_CLASS:
            continue
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        signs = torch.where(torch.rand(16, generator=gen) >= 0.5, 1, -1).to(torch.int8)
        sr_seed = torch.randint(-(2**62), 2**62, (1,), generator=gen, dtype=torch.int64)
        with torch.no_grad():
            module._rht_sign_vector.copy_(signs.to(module._rht_sign_vector.device))
            module._sr_seed.copy_(sr_seed.to(module._sr_seed.device))
        module._refresh_rht_sign_vector_tuple()
        n += 1
    return n


def cast_of(module: nn.Module) -> str:
    """'mxfp8' or 'nvfp4' for a torchao block-format layer."""
    return "mxfp8" if type(module).__name__ == MXFP8_CLASS else "nvfp4"
