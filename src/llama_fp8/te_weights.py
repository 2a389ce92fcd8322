"""Hugging Face Llama <-> TE Llama weight names, and a streaming safetensors loader.

Pure tensor code (no Transformer Engine import), so it is tested on any CPU machine.
The TE side is :mod:`llama_fp8.te_llama`'s model, built from ``te.TransformerLayer`` with
``fuse_qkv_params=False``; its per-layer parameter names (checked against TE's own state_dict in
tests/te_real) are::

    model.layers.N.te_layer.self_attention.layernorm_qkv.{layer_norm_weight,query_weight,key_weight,value_weight}
    model.layers.N.te_layer.self_attention.proj.weight
    model.layers.N.te_layer.layernorm_mlp.{layer_norm_weight,fc1_weight,fc2_weight}

``fc1_weight`` (2*ffn, hidden) is ``[gate_proj; up_proj]``: TE's swiglu applies SiLU to the first
half. Embedding, final norm and LM head keep HF's names. TE's ``*._extra_state`` entries (FP8
metadata) have no HF counterpart and are skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV = "te_layer.self_attention.layernorm_qkv."
_MLP = "te_layer.layernorm_mlp."
# HF suffix inside a layer -> (TE suffix inside the layer, row block in a fused weight or None)
_LAYER_MAP: dict[str, tuple[str, int | None]] = {
    "input_layernorm.weight": (_QKV + "layer_norm_weight", None),
    "self_attn.q_proj.weight": (_QKV + "query_weight", None),
    "self_attn.k_proj.weight": (_QKV + "key_weight", None),
    "self_attn.v_proj.weight": (_QKV + "value_weight", None),
    "self_attn.o_proj.weight": ("te_layer.self_attention.proj.weight", None),
    "post_attention_layernorm.weight": (_MLP + "layer_norm_weight", None),
    "mlp.gate_proj.weight": (_MLP + "fc1_weight", 0),
    "mlp.up_proj.weight": (_MLP + "fc1_weight", 1),
    "mlp.down_proj.weight": (_MLP + "fc2_weight", None),
}
_TE_LAYER_MAP: dict[str, list[str]] = {}
for _hf, (_te, _part) in _LAYER_MAP.items():
    _TE_LAYER_MAP.setdefault(_te, []).append(_hf)  # insertion order = block order (gate, up)
_SAME_NAME = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
# Non-persistent in current HF, but saved by some older conversions; recomputed, never loaded.
_IGNORED_HF = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")

WriteFn = Callable[[str, "slice | None", torch.Tensor], None]


def hf_to_te_key(name: str) -> tuple[str, int | None]:
    """HF tensor name -> (TE key, block index in a fused TE weight or None). Unknown: ValueError."""
    if name in _SAME_NAME:
        return name, None
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_MAP:
        te_suffix, part = _LAYER_MAP[m.group(2)]
        return f"model.layers.{m.group(1)}.{te_suffix}", part
    raise ValueError(f"unexpected tensor {name!r}: no TE Llama parameter corresponds to it")


def te_to_hf_keys(te_key: str) -> list[str]:
    """TE key -> HF names, one per row block (fc1_weight: gate, up). Unknown: ValueError."""
    if te_key in _SAME_NAME:
        return [te_key]
    m = _LAYER.match(te_key)
    if m and m.group(2) in _TE_LAYER_MAP:
        return [f"model.layers.{m.group(1)}.{s}" for s in _TE_LAYER_MAP[m.group(2)]]
    raise ValueError(f"unexpected TE key {te_key!r}: no HF Llama tensor corresponds to it")


def num_blocks(te_key: str) -> int:
    """How many HF tensors are stacked (along dim 0) into ``te_key``."""
    return len(te_to_hf_keys(te_key))


def expected_te_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Shape of every TE model parameter (``_extra_state`` aside) for a LlamaConfig ``cfg``."""
    hidden, ffn, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q_rows = cfg.num_attention_heads * head_dim
    kv_rows = (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim
    per_layer = {
        _QKV + "layer_norm_weight": (hidden,),
        _QKV + "query_weight": (q_rows, hidden),
        _QKV + "key_weight": (kv_rows, hidden),
        _QKV + "value_weight": (kv_rows, hidden),
        "te_layer.self_attention.proj.weight": (hidden, q_rows),
        _MLP + "layer_norm_weight": (hidden,),
        _MLP + "fc1_weight": (2 * ffn, hidden),
        _MLP + "fc2_weight": (hidden, ffn),
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def te_state_to_hf(te_state: Mapping[str, torch.Tensor], tie_word_embeddings: bool = False) -> dict:
    """TE state dict -> HF names (for export). Fused fc1 is split into gate/up views.

    With tied embeddings ``lm_head.weight`` is left out, as ``save_pretrained`` does.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in te_state.items():
        if key.endswith("_extra_state") or (tie_word_embeddings and key == "lm_head.weight"):
            continue
        names = te_to_hf_keys(key)
        if value.shape[0] % len(names):
            raise ValueError(f"{key} has {value.shape[0]} rows, not divisible into {len(names)} blocks")
        for name, block in zip(names, value.chunk(len(names), dim=0), strict=True):
            out[name] = block
    return out


# --------------------------------------------------------------------------- streaming loader


def _shard_plan(hf_dir: Path) -> dict[Path, list[str]]:
    """safetensors file -> tensor names, from model.safetensors.index.json or model.safetensors."""
    index = hf_dir / "model.safetensors.index.json"
    single = hf_dir / "model.safetensors"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        plan: dict[Path, list[str]] = {}
        for name, file in sorted(weight_map.items()):
            plan.setdefault(hf_dir / file, []).append(name)
        return plan
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {single: sorted(f.keys())}
    raise FileNotFoundError(
        f"{hf_dir}: neither model.safetensors.index.json nor model.safetensors found "
        "(only safetensors Hugging Face checkpoints are supported)"
    )


def _tied(hf_dir: Path) -> bool:
    config = hf_dir / "config.json"
    return bool(config.is_file() and json.loads(config.read_text()).get("tie_word_embeddings", False))


def _rows(te_key: str, part: int | None, src: tuple, dst: tuple) -> slice | None:
    """Row block of ``dst`` that an HF tensor of shape ``src`` fills; ValueError on a mismatch."""
    if part is None:
        if tuple(src) != tuple(dst):
            raise ValueError(f"{te_key}: checkpoint shape {tuple(src)} != model shape {tuple(dst)}")
        return None
    n = dst[0] // num_blocks(te_key)
    if (src[0], *src[1:]) != (n, *dst[1:]):
        raise ValueError(f"{te_key} block {part}: checkpoint shape {tuple(src)} != ({n}, {dst[1:]})")
    return slice(part * n, (part + 1) * n)


def _plan_writes(
    plan: Mapping[Path, list[str]], shapes: Mapping[str, tuple], tied: bool
) -> list[tuple[Path, str, str, slice | None]]:
    """(file, HF name, TE key, rows) for every tensor to load; errors name every problem at once."""
    from safetensors import safe_open

    writes, problems, seen = [], [], {}
    for file, names in plan.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if _IGNORED_HF.match(name) or (tied and name == "lm_head.weight"):
                    continue
                try:
                    te_key, part = hf_to_te_key(name)
                except ValueError as e:
                    problems.append(str(e))
                    continue
                if te_key not in shapes:
                    problems.append(f"unexpected tensor {name!r}: the model has no {te_key!r}")
                    continue
                if (te_key, part) in seen:
                    problems.append(f"tensor {name!r} appears twice ({seen[(te_key, part)]}, {file})")
                    continue
                seen[(te_key, part)] = file
                shape = tuple(f.get_slice(name).get_shape())
                writes.append((file, name, te_key, _rows(te_key, part, shape, shapes[te_key])))
    for te_key in shapes:
        if tied and te_key == "lm_head.weight":
            continue
        for part, name in enumerate(te_to_hf_keys(te_key)):
            block = part if num_blocks(te_key) > 1 else None
            if (te_key, block) not in seen:
                problems.append(f"missing tensor {name!r} (for {te_key!r})")
    if problems:
        raise ValueError("HF checkpoint does not match the TE model:\n  " + "\n  ".join(problems))
    return writes


def copy_into(target: Mapping[str, torch.Tensor]) -> WriteFn:
    """Default writer: copy (with dtype cast) into plain tensors, e.g. ``model.state_dict()``."""

    @torch.no_grad()
    def write(te_key: str, rows: slice | None, tensor: torch.Tensor) -> None:
        dst = target[te_key] if rows is None else target[te_key][rows]
        dst.copy_(tensor)

    return write


def load_hf_checkpoint_into_te(
    target: Mapping[str, Any],
    hf_dir: str | Path,
    write: WriteFn | None = None,
) -> list[str]:
    """Load an HF Llama safetensors checkpoint into a TE model's tensors, one tensor at a time.

    ``target`` maps TE keys to anything with a ``.shape`` (the full, unsharded shape: plain
    tensors, meta tensors or DTensors); ``_extra_state`` keys are ignored. ``write(te_key, rows,
    tensor)`` stores one HF tensor: ``rows`` is None for a whole parameter or the ``slice`` of
    dim 0 it fills (gate and up of fc1, which may live in different shards). By default the data is
    copied into ``target``'s tensors. Names are checked before any data is read: every missing or
    unexpected tensor raises ValueError naming it. Returns the HF names loaded.
    """
    hf_dir = Path(hf_dir)
    shapes = {k: tuple(v.shape) for k, v in target.items() if not k.endswith("_extra_state")}
    plan = _shard_plan(hf_dir)
    writes = _plan_writes(plan, shapes, _tied(hf_dir))
    write = write or copy_into(target)
    from safetensors import safe_open

    by_file: dict[Path, list[tuple[str, str, slice | None]]] = {}
    for file, name, te_key, rows in writes:
        by_file.setdefault(file, []).append((name, te_key, rows))
    for file, items in by_file.items():  # one shard open at a time, one tensor in memory at a time
        with safe_open(str(file), framework="pt") as f:
            for name, te_key, rows in items:
                write(te_key, rows, f.get_tensor(name))
    return [name for _, name, _, _ in writes]
