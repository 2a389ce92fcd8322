"""Hugging Face safetensors checkpoints in and out, for every implementation.

Reading is streamed: one shard file open at a time, one tensor in memory at a time, and each rank
copies only the rows of its own FSDP shards. An implementation maps names with ``hf_to_key`` (HF name
-> its parameter name and, for a fused parameter, the row block) and ``key_to_hf`` (the reverse, one
HF name per row block); the Hugging Face implementation's mapping is the identity.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

WriteFn = Callable[[str, "slice | None", torch.Tensor], None]
# Non-persistent in current HF, but saved by some older conversions; recomputed, never loaded.
_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def shard_plan(hf_dir: Path) -> dict[Path, list[str]]:
    """safetensors file -> tensor names, from model.safetensors.index.json or model.safetensors."""
    index = hf_dir / "model.safetensors.index.json"
    single = hf_dir / "model.safetensors"
    if index.is_file():
        plan: dict[Path, list[str]] = {}
        for name, file in sorted(json.loads(index.read_text())["weight_map"].items()):
            plan.setdefault(hf_dir / file, []).append(name)
        return plan
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {single: sorted(f.keys())}
    raise FileNotFoundError(f"{hf_dir}: neither model.safetensors.index.json nor model.safetensors found "
                            "(only safetensors Hugging Face checkpoints are supported)")


def tied_in_config(hf_dir: Path) -> bool:
    config = hf_dir / "config.json"
    return bool(config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings", False))


def plan_writes(plan: Mapping[Path, list[str]], shapes: Mapping[str, tuple], tied: bool, mapping: Any
                ) -> list[tuple[Path, str, str, slice | None]]:
    """(file, HF name, key, rows) for every tensor to load; one ValueError names every problem at once.
    The HF tensors of a fused parameter are stacked along dim 0 in ``key_to_hf`` order, each taking as many
    rows as the checkpoint's tensor has (q, k and v differ with GQA); they must fill the parameter exactly."""
    from safetensors import safe_open

    found: dict[str, dict[int | None, tuple[Path, str, tuple]]] = {}
    problems: list[str] = []
    for file, names in plan.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if _IGNORED.match(name) or (tied and name == "lm_head.weight"):
                    continue
                try:
                    key, part = mapping.hf_to_key(name)
                except ValueError as e:
                    problems.append(str(e))
                    continue
                if key not in shapes:
                    problems.append(f"unexpected tensor {name!r} in {file.name}: the model has no {key!r}")
                elif part in found.setdefault(key, {}):
                    problems.append(f"tensor {name!r} appears twice ({found[key][part][0].name}, {file.name})")
                else:
                    found[key][part] = (file, name, tuple(f.get_slice(name).get_shape()))
    writes: list[tuple[Path, str, str, slice | None]] = []
    for key, dst in shapes.items():
        if tied and key == "lm_head.weight":
            continue
        hf_names = mapping.key_to_hf(key)
        parts = [None] if len(hf_names) == 1 else list(range(len(hf_names)))
        missing = [f"missing tensor {n!r} (for {key!r})" for p, n in zip(parts, hf_names) if p not in found.get(key, {})]
        if missing:
            problems += missing
            continue
        problems += _place(key, tuple(dst), [found[key][p] for p in parts], writes)
    if problems:
        raise ValueError("the checkpoint does not match the model:\n  " + "\n  ".join(problems))
    return writes


def _place(key: str, dst: tuple, blocks: list[tuple[Path, str, tuple]], writes: list) -> list[str]:
    """Append the writes of ``key``'s blocks (in order) to ``writes``; return the problems found."""
    if len(blocks) == 1:
        file, name, shape = blocks[0]
        if shape != dst:
            return [f"{name} has shape {shape}, the model expects {dst}"]
        writes.append((file, name, key, None))
        return []
    bad = [f"{name} has shape {shape}, the model expects (rows, {', '.join(map(str, dst[1:]))}) (a block of {key})"
           for _, name, shape in blocks if shape[1:] != dst[1:]]
    total = sum(shape[0] for _, _, shape in blocks)
    if not bad and total != dst[0]:
        bad.append(f"{' + '.join(f'{n} ({s[0]} rows)' for _, n, s in blocks)} = {total} rows, but {key} has "
                   f"{dst[0]}")
    row = 0
    for file, name, shape in () if bad else blocks:
        writes.append((file, name, key, slice(row, row + shape[0])))
        row += shape[0]
    return bad


def copy_into(target: Mapping[str, torch.Tensor]) -> WriteFn:
    """Writer into plain tensors (e.g. ``model.state_dict()``), with a dtype cast."""

    @torch.no_grad()
    def write(key: str, rows: slice | None, tensor: torch.Tensor) -> None:
        (target[key] if rows is None else target[key][rows]).copy_(tensor)

    return write


def sharded_writer(params: Mapping[str, torch.Tensor]) -> WriteFn:
    """Writer into (possibly FSDP-sharded) parameters: each rank copies only the rows it holds."""
    from llama_fp8.models.common import local_part

    @torch.no_grad()
    def write(key: str, rows: slice | None, tensor: torch.Tensor) -> None:
        local, offset, _ = local_part(params[key])
        row0, lo, hi = offset[0], *((0, tensor.shape[0]) if rows is None else (rows.start, rows.stop))
        a, b = max(lo, row0), min(hi, row0 + local.shape[0])
        if a < b:  # the part of this (block of the) tensor that this rank holds: its rows, then its columns
            cols = (slice(None), *(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:])))
            local[a - row0:b - row0].copy_(tensor[a - lo:b - lo][cols].to(local.dtype))

    return write


def load(target: Mapping[str, Any], hf_dir: str | Path, mapping: Any, write: WriteFn | None = None) -> list[str]:
    """Load an HF safetensors checkpoint into ``target`` (key -> anything with the full ``.shape``: plain,
    meta or DTensor parameters), one tensor at a time. ``mapping`` has ``hf_to_key``/``key_to_hf``.
    Names and shapes are checked before any data is read; ``_extra_state`` keys are ignored. A target
    without ``lm_head.weight`` (tied embeddings) skips the checkpoint's. Returns the HF names loaded."""
    hf_dir = Path(hf_dir)
    shapes = {k: tuple(v.shape) for k, v in target.items() if not k.endswith("_extra_state")}
    tied = tied_in_config(hf_dir) or "lm_head.weight" not in shapes
    writes = plan_writes(shard_plan(hf_dir), shapes, tied, mapping)
    write = write or copy_into(target)
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str, slice | None]]] = {}
    for file, name, key, rows in writes:
        by_file.setdefault(file, []).append((name, key, rows))
    for file, items in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name, key, rows in items:
                write(key, rows, f.get_tensor(name))
    return [name for _, name, _, _ in writes]


def load_into_model(model: nn.Module, hf_dir: str, mapping: Any) -> None:
    """``--init_from_hf``: stream a checkpoint into a materialized, possibly sharded model."""
    from llama_fp8.models.common import canonical_name

    params = {canonical_name(n): p for n, p in model.named_parameters()}  # tied weights appear once
    load(params, hf_dir, mapping, write=sharded_writer(params))


def to_hf_names(state: Mapping[str, torch.Tensor], mapping: Any, tie_word_embeddings: bool) -> dict:
    """A model's full state dict -> HF names; fused parameters are split into their row blocks (views, of the
    sizes ``mapping.block_sizes(key, rows)`` gives).
    With tied embeddings ``lm_head.weight`` is left out, as ``save_pretrained`` does."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith("_extra_state") or (tie_word_embeddings and key == "lm_head.weight"):
            continue
        names = mapping.key_to_hf(key)
        if len(names) == 1:
            out[names[0]] = value
            continue
        sizes = mapping.block_sizes(key, value.shape[0])
        if sum(sizes) != value.shape[0]:
            raise ValueError(f"{key} has {value.shape[0]} rows, not the {' + '.join(map(str, sizes))} of its blocks")
        out.update(zip(names, value.split(sizes, dim=0), strict=True))
    return out
