"""What every implementation shares: the HF LlamaConfig of a run, size and FLOPs, and the
sharding-independent weight init and its check.

Imports nothing from torch.distributed: sharding lives in ``parallel/``. The one exception is the init,
which reads a DTensor's placement (if it is one) to know which rows of the full tensor it holds.

``cfg`` is always a resolved ``llama_fp8.config.TrainConfig``, read by attribute and never imported: the
config's parser asks this package's registry for ``--model_impl``'s choices, so an import back would be a
cycle (tests/test_architecture.py).
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

INIT_BLOCK_ROWS = 256
"""Rows of a parameter drawn from one seeded generator; independent of the world size, so the same
seed gives the same weights on 1, 2 or 64 ranks while each rank only generates its own rows."""


def hf_config(cfg):
    """The transformers.LlamaConfig for a resolved TrainConfig."""
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling:
        rope = {**cfg.rope_scaling, "rope_theta": float(cfg.rope_theta)}
        rope.setdefault("rope_type", rope.pop("type", "default"))
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_width,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        initializer_range=cfg.initializer_range,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        rope_parameters=rope,
        use_cache=False,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


@dataclass(frozen=True)
class ModelSize:
    num_params: int
    """All trainable parameters (tied embeddings counted once)."""
    num_embedding_params: int
    flops_per_token: float
    """Training FLOPs per token: 6 * N_matmul + 12 * layers * heads * head_dim * seq (fwd + bwd)."""


def model_size(model: nn.Module, cfg) -> ModelSize:
    """Parameter count and training FLOPs per token, from the (meta) model's shapes.

    N_matmul is every parameter taking part in a matmul per token: all but the input embedding, which
    is a lookup - except when it is tied to the output head, where its weight does a matmul. Norm
    weights are included (negligible). The attention term counts QK^T and AV over the full sequence.
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    emb = model.get_input_embeddings().weight.numel()
    tied = bool(cfg.tie_word_embeddings)
    n_matmul = total if tied else total - emb
    head_dim = cfg.hidden_width // cfg.num_heads
    attn = 12 * cfg.num_layers * cfg.num_heads * head_dim * cfg.max_context_width
    return ModelSize(num_params=total, num_embedding_params=emb, flops_per_token=6.0 * n_matmul + attn)


def local_part(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, its offset in the full tensor along each dimension, the full shape) for a plain tensor
    or a DTensor sharded along any dimensions (FSDP2 along rows; tensor parallelism along rows or columns)."""
    if not hasattr(p, "to_local"):
        return p, (0,) * p.dim(), tuple(p.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return p.to_local(), tuple(offset), tuple(p.shape)


def _cols(local: torch.Tensor, offset: tuple[int, ...]) -> tuple[slice, ...]:
    """Index of the local part's columns (every dimension after the first) in full-width rows."""
    return (slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:])))


@torch.no_grad()
def fill_normal_(p: torch.Tensor, std: float, seed: int, name: str) -> None:
    """Fill p (or its local shard) with N(0, std) drawn block by block from generators seeded by
    (seed, name, block). Values are identical whatever the sharding; only local rows are generated."""
    local, offset, full = local_part(p)
    fill_part_normal_(local, offset, full, std, seed, name)


@torch.no_grad()
def fill_part_normal_(local: torch.Tensor, offset: tuple[int, ...], full_shape: tuple[int, ...], std: float,
                      seed: int, name: str) -> None:
    """``fill_normal_`` for the part of parameter ``name`` (full shape ``full_shape``) that starts at
    ``offset``: full-width rows are drawn, the part's columns cut out of them."""
    if local.numel() == 0:
        return
    row0, rows, cols = offset[0], local.shape[0], _cols(local, offset)
    first, last = row0 // INIT_BLOCK_ROWS, (row0 + rows - 1) // INIT_BLOCK_ROWS
    gen = torch.Generator(device=local.device)
    base = zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)
    for block in range(first, last + 1):
        gen.manual_seed((base * 1_000_003 + block) % (2**63))
        b0 = block * INIT_BLOCK_ROWS
        values = torch.empty((INIT_BLOCK_ROWS, *full_shape[1:]), device=local.device, dtype=torch.float32)
        values.normal_(0.0, std, generator=gen)
        lo, hi = max(b0, row0), min(b0 + INIT_BLOCK_ROWS, row0 + rows)
        local[lo - row0:hi - row0].copy_(values[lo - b0:hi - b0][cols])


def canonical_name(name: str) -> str:
    """A parameter's name without wrapper prefixes (activation checkpointing, torch.compile), so init
    seeds, HF names and checkpoints do not depend on those options."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


Blocks = list[tuple[str, int, int]]
"""Row blocks of a parameter: (the name whose seed draws them, first row in the parameter, rows)."""


@torch.no_grad()
def init_weights(model: nn.Module, cfg, skip: set[int] = frozenset(),
                 blocks_of: Callable[[str, int], Blocks | None] | None = None) -> None:
    """Initialize every parameter (but those whose id is in ``skip``) after ``to_empty``; each rank fills
    only its own rows. ``blocks_of(name, rows)`` may split a fused parameter into the tensors it stacks, each
    drawn under its own name (so a fused weight starts from the same values as its unfused counterparts)."""
    seen: set[int] = set(skip)
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local, offset, full = local_part(p)
        name = canonical_name(name)
        init_part_(local, offset, full, name, cfg, blocks_of(name, p.shape[0]) if blocks_of and p.dim() >= 2 else None)


@torch.no_grad()
def init_part_(local: torch.Tensor, offset: tuple[int, ...], full_shape: tuple[int, ...], name: str,
               cfg, blocks: Blocks | None = None) -> None:
    """HF Llama's init of the part of parameter ``name`` at ``offset``: N(0, initializer_range) for matrices
    (by ``blocks`` of rows, default: the whole parameter under its own name), zeros for biases, ones for norm
    weights."""
    if local.dim() < 2:
        local.zero_() if name.endswith("bias") else local.fill_(1.0)  # RMSNorm weights: ones
        return
    row0, end = offset[0], offset[0] + local.shape[0]
    for seed_name, start, rows in blocks or [(name, 0, full_shape[0])]:
        lo, hi = max(start, row0), min(start + rows, end)
        if lo < hi:
            fill_part_normal_(local[lo - row0:hi - row0], (lo - start, *offset[1:]), (rows, *full_shape[1:]),
                              cfg.initializer_range, cfg.seed, seed_name)


@torch.no_grad()
def check_weights(model: nn.Module, cfg, skip: set[int] = frozenset()) -> None:
    """Sanity check after init or load: finite values, and matrix stds near the configured init (parameters
    whose id is in ``skip`` are not checked)."""
    for name, p in model.named_parameters():
        if id(p) in skip:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel() == 0:
            continue
        # In row chunks: a boolean copy of a whole embedding shard would be the largest allocation of init.
        rows = local.reshape(local.shape[0], -1) if local.dim() else local.reshape(1, 1)
        if not all(torch.isfinite(rows[i:i + 4096]).all() for i in range(0, rows.shape[0], 4096)):
            raise RuntimeError(f"parameter {name} has non-finite values after initialization")
        if p.dim() >= 2 and local.numel() > 1000:
            std = local.float().std().item()
            assert 0.5 * cfg.initializer_range < std < 2 * cfg.initializer_range, (
                f"{name}: std {std:.4g} is far from initializer_range {cfg.initializer_range}")
