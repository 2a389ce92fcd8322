"""Transformer Engine's FP8 scaling state in our checkpoints: as plain tensors, never as pickles.

TE keeps each module's delayed-scaling state (per-tensor scales and an amax history) in ``fp8_meta`` and
serializes it through ``get_extra_state`` as a pickled dict in a uint8 tensor whose size varies with the
payload. A fresh model's extra state is empty, so DCP cannot load the saved one into it ("Size mismatch
between saved torch.Size([97]) and current: torch.Size([0])", NVIDIA/TransformerEngine#1860), and
unpickling a checkpoint could run code (TE >= 2.16.1 refuses unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1,
which we never set). So, for every TE module of our model:

- ``_extra_state`` is always saved as an empty tensor, and whatever a checkpoint holds there is replaced by
  ``None`` before TE sees it ("nothing to restore", ``set_extra_state``): no pickle is written or read, ever.
  A module's own load pre-hook comes too late for that where TE's primary weights are FP8: TE 2.20's
  ``_load_from_state_dict`` then calls ``set_extra_state`` with the checkpoint's value before the module's
  pre-hooks run (transformer_engine/pytorch/module/base.py). So the model's root gets a pre-hook too, which
  runs before any child module is loaded (``nn.Module.load_state_dict`` derives each child's entries after
  its parent's hooks), and loads go through the root, as the checkpointer's do;
- with DelayedScaling, the scales and amax histories are persistent buffers (``fp8_scale_fwd``,
  ``fp8_amax_history_fwd``, ``fp8_scale_bwd``, ``fp8_amax_history_bwd``) that *are* the tensors TE uses
  (TE's quantizers hold views of them and its global amax buffers hold references): a checkpoint load
  copies the saved values into them in place, so a resumed run continues with the same scales. Their
  shapes are fixed by the recipe (amax_history_len) and the module (3 / 2 tensors per GEMM forward /
  backward), so DCP reshards and loads them like any replicated tensor.

Stateless recipes (current, mxfp8, block) have no such state: only the empty extra state is saved.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

EXTRA_STATE = "_extra_state"
SCALING = {"fwd": "scaling_fwd", "bwd": "scaling_bwd"}
BUFFERS = tuple(f"fp8_{what}_{tag}" for tag in SCALING for what in ("scale", "amax_history"))
# GEMMs per forward of the TE modules in a TransformerLayer (the ``num_gemms`` each passes to
# ``prepare_forward``: transformer_engine/pytorch/module/layernorm_mlp.py and
# transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py); others have one.
GEMMS_BY_CLASS = {"LayerNormMLP": 2, "DotProductAttention": 3}


def te_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The Transformer Engine modules of ``model`` (TE's base module: ``fp8_meta`` + ``get_extra_state``)."""
    for name, module in model.named_modules():
        if hasattr(module, "fp8_meta") and hasattr(module, "get_extra_state"):
            yield name, module


def num_gemms(module: nn.Module) -> int:
    return int(getattr(module, "num_gemms", 0) or GEMMS_BY_CLASS.get(type(module).__name__, 1))


@torch.no_grad()
def init_scaling_state(model: nn.Module, autocast: contextlib.AbstractContextManager) -> int:
    """Allocate every TE module's FP8 state now, as its first forward under ``autocast`` would, so that a
    checkpoint has tensors of the final shapes to load into. Returns the number of modules. (CUDA: TE
    allocates the state on the current CUDA device.)"""
    modules = list(te_modules(model))
    with autocast:
        for _, module in modules:
            module.init_fp8_metadata(num_gemms=num_gemms(module))
    return len(modules)


def expose_scaling_state(model: nn.Module) -> int:
    """Register the delayed-scaling tensors of every TE module as persistent buffers (aliases, not copies).
    Returns how many tensors were exposed (0 without DelayedScaling state)."""
    count = 0
    for _, module in te_modules(model):
        for tag, key in SCALING.items():
            state = module.fp8_meta.get(key)
            if state is None or not hasattr(state, "amax_history"):
                continue  # stateless recipe, or no FP8 yet
            for what, tensor in (("scale", state.scale), ("amax_history", state.amax_history)):
                module.register_buffer(f"fp8_{what}_{tag}", tensor, persistent=True)
                count += 1
    return count


def keep_pickles_out(model: nn.Module) -> int:
    """Hooks on every TE module: its extra state is saved empty and never loaded; one on ``model`` itself that
    empties every TE module's extra state before any of them is loaded. Returns the module count."""
    modules = list(te_modules(model))
    for _, module in modules:
        module.register_state_dict_post_hook(_save_empty_extra_state)
        module.register_load_state_dict_pre_hook(_load_no_extra_state)
    keys = tuple(f"{name}.{EXTRA_STATE}" if name else EXTRA_STATE for name, _ in modules)
    if modules:
        model.register_load_state_dict_pre_hook(functools.partial(_load_none_for, keys))
    return len(modules)


def _load_none_for(keys: tuple[str, ...], module, state_dict, prefix, *args) -> None:
    for key in keys:
        if prefix + key in state_dict:
            state_dict[prefix + key] = None


def _save_empty_extra_state(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + EXTRA_STATE
    if key in state_dict:
        state_dict[key] = torch.empty(0, dtype=torch.uint8)


def _load_no_extra_state(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    key = prefix + EXTRA_STATE
    if key in state_dict:
        state_dict[key] = None  # TE's set_extra_state(None): nothing to restore, nothing unpickled
