"""Presets' published sizes, the HF config they produce, FLOPs, and the sharding-independent init."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import build_meta
from llama_fp8 import config as C
from llama_fp8 import models
from llama_fp8.models import common as M


def cfg_for(*args: str) -> C.TrainConfig:
    return C.parse_args(list(args))


# Published parameter counts (model cards / papers): Llama 2 7B 6.74 B, 13B 13.02 B, 70B 68.98 B;
# Llama 3.1 8B 8.03 B, 70B 70.6 B; Llama 3.2 1B 1.24 B, 3B 3.21 B.
@pytest.mark.parametrize("preset, published", [
    ("llama2-7b", 6.74e9), ("llama2-13b", 13.02e9), ("llama2-70b", 68.98e9),
    ("llama3.1-8b", 8.03e9), ("llama3.1-70b", 70.6e9), ("llama3.2-1b", 1.24e9), ("llama3.2-3b", 3.21e9),
])
def test_preset_parameter_counts_match_published(preset, published):
    cfg = cfg_for("--model", preset)
    model = build_meta(cfg)
    assert next(model.parameters()).device.type == "meta"
    n = M.model_size(model, cfg).num_params
    assert abs(n - published) / published < 0.005, f"{preset}: {n / 1e9:.3f} B vs {published / 1e9} B"


def test_hf_config_carries_rope_gqa_and_tying():
    c2 = M.hf_config(cfg_for("--model", "llama2-70b"))
    assert c2.rope_parameters["rope_theta"] == 10000.0 and c2.num_key_value_heads == 8
    c3 = M.hf_config(cfg_for("--model", "llama3.1-8b"))
    assert c3.rope_parameters["rope_theta"] == 500000.0 and c3.rope_parameters["rope_type"] == "llama3"
    assert c3.rope_parameters["factor"] == 8.0 and c3.vocab_size == 128256
    c32 = M.hf_config(cfg_for("--model", "llama3.2-1b"))
    assert c32.tie_word_embeddings and c32.head_dim == 64


@pytest.mark.parametrize("flag, value, attr, expected", [
    ("--vocab_size", "1024", "vocab_size", 1024), ("--hidden_width", "256", "hidden_size", 256),
    ("--num_layers", "3", "num_hidden_layers", 3), ("--num_heads", "8", "num_attention_heads", 8),
    ("--num_key_value_heads", "4", "num_key_value_heads", 4),
    ("--intermediate_size", "512", "intermediate_size", 512),
    ("--initializer_range", "0.01", "initializer_range", 0.01), ("--rms_norm_eps", "1e-6", "rms_norm_eps", 1e-6),
    ("--tie_word_embeddings", "1", "tie_word_embeddings", True),
    ("--max_position_embeddings", "4096", "max_position_embeddings", 4096),
])
def test_shape_flags_reach_the_model(flag, value, attr, expected):
    hfc = M.hf_config(cfg_for("--model", "tiny", flag, value))
    assert getattr(hfc, attr) == expected


def test_rope_flags_reach_the_model():
    hfc = M.hf_config(cfg_for("--model", "tiny", "--rope_theta", "250000"))
    assert hfc.rope_parameters["rope_theta"] == 250000.0
    hfc = M.hf_config(cfg_for("--model", "tiny", "--rope_scaling",
                              "{rope_type: llama3, factor: 4.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
                              "original_max_position_embeddings: 64}"))
    assert hfc.rope_parameters["rope_type"] == "llama3" and hfc.rope_parameters["factor"] == 4.0


def test_max_context_width_raises_rope_range():
    cfg = cfg_for("--model", "tiny", "--max_context_width", "512")
    assert cfg.max_context_width == 512 and M.hf_config(cfg).max_position_embeddings == 512


def test_flops_per_token_formula():
    cfg = cfg_for("--model", "tiny")
    model = build_meta(cfg)
    s = M.model_size(model, cfg)
    emb = cfg.vocab_size * cfg.hidden_width
    expected = 6 * (s.num_params - emb) + 12 * cfg.num_layers * cfg.num_heads * (cfg.hidden_width // cfg.num_heads) \
        * cfg.max_context_width
    assert s.flops_per_token == expected and s.num_embedding_params == emb
    tied = cfg_for("--model", "tiny", "--tie_word_embeddings", "1")
    st = M.model_size(build_meta(tied), tied)
    assert st.num_params == s.num_params - emb           # the head shares the embedding
    assert st.flops_per_token == 6 * st.num_params + 12 * 4 * 4 * 32 * 128   # ... and does a matmul


def materialize(cfg: C.TrainConfig) -> nn.Module:
    model = build_meta(cfg)
    model.to_empty(device="cpu")
    models.get("hf").init_weights(model, cfg, torch.device("cpu"))
    return model


def test_init_statistics_and_rope_buffers():
    cfg = cfg_for("--model", "tiny", "--model_type", "llama_v3")
    model = materialize(cfg)
    M.check_weights(model, cfg)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert abs(q.std().item() - cfg.initializer_range) < 0.002
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    fresh = LlamaRotaryEmbedding(M.hf_config(cfg))
    assert torch.allclose(model.model.rotary_emb.inv_freq, fresh.inv_freq)  # theta 500000, not garbage


def test_initializer_range_and_seed_change_the_weights():
    a = materialize(cfg_for("--model", "tiny"))
    b = materialize(cfg_for("--model", "tiny"))
    c = materialize(cfg_for("--model", "tiny", "--seed", "7"))
    d = materialize(cfg_for("--model", "tiny", "--initializer_range", "0.04"))
    wa, wb = a.model.embed_tokens.weight, b.model.embed_tokens.weight
    assert torch.equal(wa, wb)
    assert not torch.equal(wa, c.model.embed_tokens.weight)
    assert abs(d.model.embed_tokens.weight.std().item() - 0.04) < 0.002


def test_fill_normal_rows_do_not_depend_on_the_split(monkeypatch):
    """The same rows come out whether a rank holds rows [0, 300) or [300, 700) of a 700-row tensor."""
    full = torch.empty(700, 24)
    M.fill_normal_(full, 0.02, 3, "w")
    for lo, hi in ((0, 300), (300, 700), (250, 260)):
        part = torch.empty(hi - lo, 24)
        monkeypatch.setattr(M, "local_part", lambda p, lo=lo: (p, (lo, 0), (700, 24)))
        M.fill_normal_(part, 0.02, 3, "w")
        assert torch.equal(part, full[lo:hi])


def test_fill_normal_columns_do_not_depend_on_the_split(monkeypatch):
    """Tensor parallelism shards row-parallel weights along columns (FSDP2 then along rows): a rank holding
    rows [300, 700) x columns [8, 16) gets exactly that block of the full init."""
    full = torch.empty(700, 24)
    M.fill_normal_(full, 0.02, 3, "w")
    part = torch.empty(400, 8)
    monkeypatch.setattr(M, "local_part", lambda p: (p, (300, 8), (700, 24)))
    M.fill_normal_(part, 0.02, 3, "w")
    assert torch.equal(part, full[300:, 8:16])


def test_model_impl_auto_is_hf_on_cpu_whatever_fp8():
    for fp8 in ("0", "1"):
        cfg = cfg_for("--model", "tiny", "--fp8", fp8)
        assert models.resolve(cfg.model_impl, torch.device("cpu")).name == "hf"


def test_model_impl_te_without_te_says_how_to_get_it():
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine is installed here")
    except ImportError:
        pass
    with pytest.raises(C.ConfigError, match="--model_impl te: .*container"):
        models.get("te").check(cfg_for("--model", "tiny", "--model_impl", "te"), torch.device("cuda", 0))
    with pytest.raises(C.ConfigError, match="--model_impl te .*needs a CUDA GPU"):
        models.get("te").check(cfg_for("--model", "tiny", "--model_impl", "te"), torch.device("cpu"))
