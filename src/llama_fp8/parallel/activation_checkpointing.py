"""Activation checkpointing of one decoder block with torch's checkpoint wrapper (the default of every
model implementation; an implementation may bring its own, as the TE model does).

- ``full``: the block keeps its input only and recomputes everything in backward.
- ``selective``: torch's selective checkpointing with a per-op policy. A Llama block runs seven matmuls, in this
  order: q, k, v (attention's input projections), o (its output projection), gate, up (the MLP's input
  projections), down (its output projection). What each costs to keep is its output (tokens x its width x 2 bytes);
  what it costs to recompute is its FLOPs (tokens x its width x 2 x the hidden size): the same bytes per FLOP for
  every one but down. Kept: the attention's output (its FLOPs grow with the sequence, its output does not) and the
  outputs of q, k, v, o and gate. Recomputed: everything else, i.e. the norms, RoPE, SiLU and the products (cheap
  elementwise ops with large FP32 intermediates) and the up projection (the widest output, 3.5 x the hidden size
  in Llama 3). Not kept: down's output, which nothing in the block's backward reads and which the recomputation
  never reaches (it stops once the last tensor backward needs is made, before down runs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

MATMULS = ("q", "k", "v", "o", "gate", "up", "down")
"""A Llama block's matmuls in the order its forward runs them (the policy counts matmuls to name them)."""
SELECTIVE_KEEPS = ("q", "k", "v", "o", "gate")
"""The matmul outputs ``selective`` keeps; the others are recomputed (or, down's, never needed)."""


def _ops():
    """(matmul ops, ops whose outputs are always kept): torch.ops resolved at call time."""
    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    keep = {aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            # FP8 tensorwise scales: one number each, and recomputing one under TP would all-reduce again
            aten.max.default}
    return matmuls, keep


def selective_contexts(keeps: tuple[str, ...]) -> Callable:
    """``context_fn`` for torch's checkpoint: called once per checkpointed forward, it returns the (forward,
    recomputation) contexts of a policy that keeps the outputs of the matmuls named in ``keeps`` (by their
    position in ``MATMULS``; a block with more matmuls keeps those beyond the named ones) and of attention."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = {i + 1 for i, name in enumerate(MATMULS) if name in keeps}
    matmuls, always = _ops()

    def context_fn():
        seen = {False: 0, True: 0}  # matmuls so far in this forward, and in its recomputation

        def policy(ctx, op, *args, **kwargs):
            if op in matmuls:
                seen[ctx.is_recompute] += 1
                n = seen[ctx.is_recompute]
                keep = n in kept or n > len(MATMULS)
            else:
                keep = op in always
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def wrap(layer: nn.Module, mode: str) -> nn.Module:
    """none: as is; full: recompute the whole block in backward; selective: the per-op policy above."""
    assert mode in ("none", "full", "selective"), f"--activation_checkpointing {mode!r} reached wrap()"
    if mode == "none":
        return layer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if mode == "selective":
        return checkpoint_wrapper(layer, preserve_rng_state=False, context_fn=selective_contexts(SELECTIVE_KEEPS))
    return checkpoint_wrapper(layer, preserve_rng_state=False)
