"""Llama built on Transformer Engine's ``te.TransformerLayer``, HF-shaped for shared sharding code.

``model.model.embed_tokens`` / ``model.model.layers[i]`` (a :class:`TELlamaDecoderLayer` around one
``te.TransformerLayer``) / ``model.model.norm`` / ``model.lm_head``, like ``LlamaForCausalLM``.
TE is imported lazily (``te_import``), so this module imports on a machine without TE. The FP8
side (versions, capability checks, recipes, autocast) is :mod:`llama_fp8.models.te.fp8.recipes`, the
HF<->TE weight mapping is :mod:`llama_fp8.models.te.weights`.

TE names below were checked in TE's sources (NVIDIA/TransformerEngine, v2.0 ... main):
``transformer_engine/pytorch/{transformer.py,distributed.py,attention/rope.py,module/base.py}``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llama_fp8.models.te.fp8.recipes import te_import
from llama_fp8.parallel.loss import OutputHead

# --------------------------------------------------------------------------- rotary embeddings


def rope_settings(hf_config: Any) -> tuple[float, dict]:
    """(rope_theta, scaling dict) from a LlamaConfig of transformers 4.x or 5.x.

    transformers 5 keeps theta inside ``rope_parameters`` and leaves ``config.rope_theta`` None.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta") or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(
            f"rope type {rope_type!r} is not supported by --model_impl te "
            "(supported: default, llama3); use --model_impl hf"
        )
    return float(theta), (params if rope_type == "llama3" else {})


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,), float32, with Llama 3.1 ("llama3") scaling if given.

    llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor are divided
    by ``factor``; shorter than .../high_freq_factor are kept; in between, linear interpolation in
    ``original_max_position_embeddings / wavelength``.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if not scaling:
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    # smooth = 0 -> fully scaled (long wavelengths), 1 -> unchanged (short wavelengths)
    return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq


class LlamaRotary(nn.Module):
    """RoPE frequencies in the layout of TE's ``RotaryPositionEmbedding.forward``: (T, 1, 1, D).

    TE's class allocates its ``inv_freq`` on ``torch.cuda.current_device()`` in ``__init__``, which
    defeats building on ``meta`` and leaves a persistent buffer that ``to_empty`` would wipe. This
    module holds no state: it recomputes (cheaply) per sequence length and device, with
    ``rotary_base = rope_theta`` (TE's default 10000 is wrong for Llama 3) and llama3 scaling.
    tests/te_real checks equality with TE's own class for the unscaled case.
    """

    def __init__(self, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, dict(scaling or {})
        self._cache: dict[tuple[int, str], torch.Tensor] = {}

    def forward(self, seq_len: int, device: torch.device) -> torch.Tensor:
        key = (seq_len, str(device))
        if key not in self._cache:
            # Normal tensor even if first called under inference_mode (e.g. an eval before training).
            with torch.inference_mode(False):
                self._cache = {key: self._compute(seq_len, device)}
        return self._cache[key]

    def _compute(self, seq_len: int, device: torch.device) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        pos = torch.arange(seq_len, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq)  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # non-interleaved, as HF's rotate_half
        return emb.view(seq_len, 1, 1, self.head_dim)


# --------------------------------------------------------------------------- model


@dataclass
class TECausalLMOutput:
    """Subset of HF's CausalLMOutput: ``logits`` (B, T, V; None when the forward had ``targets``) and ``loss``
    (when labels or targets are given)."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None


class TELlamaDecoderLayer(nn.Module):
    """One Llama block: a ``te.TransformerLayer`` fed with the model's rotary frequencies."""

    def __init__(self, te_layer: nn.Module):
        super().__init__()
        self.te_layer = te_layer
        self.checkpoint_fn: Callable | None = None  # set by te_checkpoint_wrap

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
        """``cu_seqlens`` (--doc_masking): the documents' boundaries in the THD layout (``hidden_states`` (t, H));
        TE's attention keeps them apart and its RoPE restarts at each."""
        kw = {} if cu_seqlens is None else {"cu_seqlens_q": cu_seqlens, "cu_seqlens_kv": cu_seqlens,
                                             "max_seqlen_q": max_seqlen, "max_seqlen_kv": max_seqlen}
        if self.checkpoint_fn is not None and torch.is_grad_enabled():
            return self.checkpoint_fn(
                self.te_layer, hidden_states, rotary_pos_emb=rotary_pos_emb, use_reentrant=False, **kw
            )
        return self.te_layer(hidden_states, rotary_pos_emb=rotary_pos_emb, **kw)


class TELlamaModel(nn.Module):
    """Backbone with HF's attribute names: embed_tokens, layers, norm (+ a stateless rotary)."""

    def __init__(self, embed: nn.Module, layers: list[nn.Module], norm: nn.Module, rotary: LlamaRotary):
        super().__init__()
        self.embed_tokens, self.layers, self.norm = embed, nn.ModuleList(layers), norm
        self.rotary = rotary

    cp_size = 1  # set by context parallelism: this rank holds 1/cp_size of each sequence

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (B, T/cp, H)
        # The angles of the whole sequence: under context parallelism TE's fused RoPE picks this rank's chunks.
        rope = self.rotary(input_ids.shape[1] * self.cp_size, hidden.device)  # (T, 1, 1, head_dim)
        if cu_seqlens is not None:  # THD: the rows' tokens as one sequence of documents, (B*T, H)
            hidden = hidden.reshape(-1, hidden.shape[-1])
        for layer in self.layers:
            hidden = layer(hidden, rope, cu_seqlens, max_seqlen) if cu_seqlens is not None else layer(hidden, rope)
        return self.norm(hidden).reshape(*input_ids.shape, -1)


class TELlamaForCausalLM(nn.Module):
    """``model.model.{embed_tokens,layers,norm}`` + ``model.lm_head``, like LlamaForCausalLM."""

    def __init__(self, config: Any, backbone: TELlamaModel, lm_head: OutputHead):
        super().__init__()
        self.config, self.model, self.lm_head = config, backbone, lm_head

    def get_input_embeddings(self) -> nn.Embedding:
        """As HF's PreTrainedModel (used by model size / FLOPs accounting)."""
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                max_seqlen: int | None = None) -> TECausalLMOutput:
        """``labels``: HF's convention (shifted here); ``targets``: aligned with ``input_ids`` already, the loss
        computed without the whole logits (``parallel/loss.py``), and no logits returned. ``cu_seqlens`` and
        ``max_seqlen``: the documents of the flattened batch (--doc_masking, ``doc_seqlens``)."""
        hidden = self.model(input_ids, cu_seqlens, max_seqlen)  # (B, T, H)
        if targets is not None:
            return TECausalLMOutput(logits=None, loss=self.lm_head(hidden, targets=targets))
        logits = self.lm_head(hidden)  # (B, T, V)
        loss = None if labels is None else causal_lm_loss(logits, labels)
        return TECausalLMOutput(logits=logits, loss=loss)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """HF's convention: position t predicts labels[t+1]; the last position and -100 are ignored."""
    shifted = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return nn.functional.cross_entropy(
        logits.float().flatten(0, -2), shifted.flatten(), ignore_index=ignore_index
    )


def _check_llama_config(cfg: Any) -> None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"--model_impl te supports hidden_act silu only, got {cfg.hidden_act!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(cfg, flag, False):
            raise ValueError(f"--model_impl te builds bias-free layers; config has {flag}=True")


def head_dim_of(cfg: Any) -> int:
    """Attention head size: ``config.head_dim`` if set, else hidden_size / num_attention_heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def doc_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """THD boundaries of a batch whose positions restart at each document (--doc_masking): int32 ``cu_seqlens``
    (the offsets at which a document starts in the flattened B*T tokens, then B*T; a row's start is always one) and the
    longest document. Computed on the host, where the counts cost no device synchronization."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    cu = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _make_te_layer(te: Any, cfg: Any, index: int, device: torch.device, doc_masking: bool = False) -> nn.Module:
    init = functools.partial(nn.init.normal_, mean=0.0, std=cfg.initializer_range)
    return te.TransformerLayer(
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_gqa_groups=cfg.num_key_value_heads or cfg.num_attention_heads,
        kv_channels=head_dim_of(cfg),
        layernorm_epsilon=cfg.rms_norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method=init,
        output_layer_init_method=init,
        layer_number=index + 1,
        # --doc_masking: packed documents as THD sequences (cu_seqlens), causal within each
        self_attn_mask_type="padding_causal" if doc_masking else "causal",
        layer_type="encoder",  # self-attention only ("decoder" adds cross-attention)
        bias=False,
        activation="swiglu",  # SiLU(first half of fc1) * second half -> fc1 = [gate; up]
        normalization="RMSNorm",
        attn_input_format="thd" if doc_masking else "bshd",
        # One QKV weight [q; k; v] (one GEMM; FP8 parameters need it: TE cannot split an FP8 weight into
        # q/k/v parameters), not interleaved per KV group, so it is HF's three weights stacked (weights.py).
        fuse_qkv_params=True,
        qkv_weight_interleaved=False,
        # A string: TE's modules test `device == "meta"` to defer init, which a torch.device fails.
        device=str(device),
    )


def build_te_llama(hf_config: Any, doc_masking: bool = False) -> TELlamaForCausalLM:
    """Llama with TE decoder layers on the current default device (``meta`` under the lead's
    ``with torch.device("meta")``: TE takes an explicit ``device`` argument, default "cuda"); ``doc_masking``: THD
    layers that take the documents' ``cu_seqlens``."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    _check_llama_config(hf_config)
    theta, scaling = rope_settings(hf_config)
    te = te_import()
    device = torch.get_default_device()
    layers = [
        TELlamaDecoderLayer(_make_te_layer(te, hf_config, i, device, doc_masking))
        for i in range(hf_config.num_hidden_layers)
    ]
    # padding_idx as in HF's LlamaModel: that row gets no gradient.
    pad = getattr(hf_config, "pad_token_id", None)
    embed = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size, pad, device=device)
    norm = LlamaRMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps).to(device)
    rotary = LlamaRotary(head_dim_of(hf_config), theta, scaling)
    lm_head = OutputHead(hf_config.hidden_size, hf_config.vocab_size, bias=False, device=device)
    if getattr(hf_config, "tie_word_embeddings", False):
        lm_head.weight = embed.weight
    return TELlamaForCausalLM(hf_config, TELlamaModel(embed, layers, norm, rotary), lm_head)


def save_param_attrs(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Public Python attributes TE puts on its parameters (e.g. ``sequence_parallel``).

    ``fully_shard`` swaps parameters for DTensors, which drops them; TE's own FSDP2 tests copy them
    back (TransformerEngine/tests/pytorch/distributed/fsdp2_tests/fsdp2_utils.py). Call before sharding, then
    :func:`restore_param_attrs` after.
    """
    return {
        name: {k: v for k, v in vars(p).items() if not k.startswith("_")}
        for name, p in model.named_parameters()
    }


def restore_param_attrs(model: nn.Module, attrs: Mapping[str, Mapping[str, Any]]) -> None:
    """Put back the attributes saved by :func:`save_param_attrs` (names are unchanged by FSDP2)."""
    for name, p in model.named_parameters():
        for key, value in attrs.get(name, {}).items():
            setattr(p, key, value)


def te_checkpoint_wrap(layer: TELlamaDecoderLayer) -> TELlamaDecoderLayer:
    """Turn on activation checkpointing with TE's ``checkpoint`` (which recomputes under the same
    FP8 autocast state). Returns the same module, so parameter names do not change."""
    if not isinstance(layer, TELlamaDecoderLayer):
        raise TypeError(f"te_checkpoint_wrap expects a TELlamaDecoderLayer, got {type(layer).__name__}")
    layer.checkpoint_fn = te_import().checkpoint
    return layer
