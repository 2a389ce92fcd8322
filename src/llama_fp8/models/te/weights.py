"""Hugging Face Llama <-> TE Llama weight names (the streaming reader is ``models.hf_io``).

Pure tensor code (no Transformer Engine import), so it is tested on any CPU machine.
The TE side is :mod:`llama_fp8.models.te.model`'s model, built from ``te.TransformerLayer`` with
``fuse_qkv_params=True, qkv_weight_interleaved=False``; its per-layer parameter names (checked against
TE's own state_dict in tests/models/te/test_te_real_structure.py) are::

    model.layers.N.te_layer.self_attention.layernorm_qkv.{layer_norm_weight,weight}
    model.layers.N.te_layer.self_attention.proj.weight
    model.layers.N.te_layer.layernorm_mlp.{layer_norm_weight,fc1_weight,fc2_weight}

Two weights are fused, their row blocks stacked in HF order:
- ``layernorm_qkv.weight`` (heads*d + 2*kv_heads*d, hidden) is ``[q_proj; k_proj; v_proj]``. Without
  interleaving TE views the projection as (heads/kv_heads + 2, kv_heads, d) and splits it along the first
  dimension (transformer_engine/pytorch/attention/multi_head_attention.py), so query head h is rows
  [h*d, (h+1)*d) and uses KV head h // (heads/kv_heads), as HF's repeat_kv. (One GEMM instead of three; FP8 parameters need it: TE cannot
  split an FP8 weight into q/k/v parameters.)
- ``fc1_weight`` (2*ffn, hidden) is ``[gate_proj; up_proj]``: TE's swiglu applies SiLU to the first half.
Embedding, final norm and LM head keep HF's names. TE's ``*._extra_state`` entries (FP8 metadata) have
no HF counterpart and are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from llama_fp8.models import hf_io

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QKV = "te_layer.self_attention.layernorm_qkv."
_MLP = "te_layer.layernorm_mlp."
# HF suffix inside a layer -> (TE suffix inside the layer, row block in a fused weight or None)
_LAYER_MAP: dict[str, tuple[str, int | None]] = {
    "input_layernorm.weight": (_QKV + "layer_norm_weight", None),
    "self_attn.q_proj.weight": (_QKV + "weight", 0),
    "self_attn.k_proj.weight": (_QKV + "weight", 1),
    "self_attn.v_proj.weight": (_QKV + "weight", 2),
    "self_attn.o_proj.weight": ("te_layer.self_attention.proj.weight", None),
    "post_attention_layernorm.weight": (_MLP + "layer_norm_weight", None),
    "mlp.gate_proj.weight": (_MLP + "fc1_weight", 0),
    "mlp.up_proj.weight": (_MLP + "fc1_weight", 1),
    "mlp.down_proj.weight": (_MLP + "fc2_weight", None),
}
_TE_LAYER_MAP: dict[str, list[str]] = {}
for _hf, (_te, _part) in _LAYER_MAP.items():
    _TE_LAYER_MAP.setdefault(_te, []).append(_hf)  # insertion order = block order (q, k, v; gate, up)
_SAME_NAME = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


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


def expected_te_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Shape of every TE model parameter (``_extra_state`` aside) for a LlamaConfig ``cfg``."""
    hidden, ffn, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q_rows = cfg.num_attention_heads * head_dim
    kv_rows = (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim
    per_layer = {
        _QKV + "layer_norm_weight": (hidden,),
        _QKV + "weight": (q_rows + 2 * kv_rows, hidden),
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


def qkv_rows(cfg: Any) -> tuple[int, int, int]:
    """Rows of q, k and v in the fused QKV weight of a LlamaConfig ``cfg``."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = (cfg.num_key_value_heads or cfg.num_attention_heads) * head_dim
    return cfg.num_attention_heads * head_dim, kv, kv


class TEMapping:
    """The TE model's names for ``models.hf_io``; with a config it can also split the fused QKV weight."""

    def __init__(self, cfg: Any = None):
        self.cfg = cfg

    hf_to_key = staticmethod(hf_to_te_key)
    key_to_hf = staticmethod(te_to_hf_keys)

    def block_sizes(self, key: str, rows: int) -> list[int]:
        """Rows of each HF tensor stacked in ``key`` (fc1: two halves; QKV: from the head counts)."""
        n = len(te_to_hf_keys(key))
        if key.endswith(_QKV + "weight"):
            if self.cfg is None:
                raise ValueError(f"{key}: splitting the fused QKV weight needs the model config")
            return list(qkv_rows(self.cfg))
        return [rows // n] * n


MAPPING = TEMapping()


def te_state_to_hf(te_state: Mapping[str, torch.Tensor], cfg: Any, tie_word_embeddings: bool = False) -> dict:
    """TE state dict -> HF names (for export), for a LlamaConfig ``cfg``. Fused QKV and fc1 are split into
    q/k/v and gate/up views. With tied embeddings ``lm_head.weight`` is left out, as ``save_pretrained`` does.
    """
    return hf_io.to_hf_names(te_state, TEMapping(cfg), tie_word_embeddings)


def load_hf_checkpoint_into_te(target: Mapping[str, Any], hf_dir: str | Path,
                               write: hf_io.WriteFn | None = None) -> list[str]:
    """Load an HF Llama safetensors checkpoint into a TE model's tensors (``target``: TE key -> full-shape
    tensor), one tensor at a time; ``write(te_key, rows, tensor)`` stores one HF tensor (``rows``: the
    slice of dim 0 a fused weight's block fills, else None; blocks are placed by the checkpoint's own
    shapes). See ``models.hf_io.load``."""
    return hf_io.load(target, hf_dir, MAPPING, write)
