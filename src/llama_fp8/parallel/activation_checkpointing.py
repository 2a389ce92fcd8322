"""Activation checkpointing of one decoder block with torch's checkpoint wrapper (the default of every
model implementation; an implementation may bring its own, as the TE model does)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn


def _save_matmuls_policy(ctx, op, *args, **kwargs):
    """Selective AC: keep the outputs of matmuls and attention (expensive to recompute, and the
    bulk of FLOPs), recompute everything else (norms, activations, rotary: cheap, memory-heavy)."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def wrap(layer: nn.Module, mode: str) -> nn.Module:
    """none: as is; full: recompute the whole block in backward; selective: per-op policy."""
    assert mode in ("none", "full", "selective"), f"--activation_checkpointing {mode!r} reached wrap()"
    if mode == "none":
        return layer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode == "selective":
        return checkpoint_wrapper(layer, preserve_rng_state=False,
                                  context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls_policy))
    return checkpoint_wrapper(layer, preserve_rng_state=False)
