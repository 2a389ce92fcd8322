"""CPU tests of the Transformer Engine path that need no TE: weight mapping, checks, API selection.

The HF checkpoints are real ones written by ``transformers.save_pretrained`` for a tiny GQA Llama.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import tiny_llama_config as tiny_config
from llama_fp8 import te_llama, te_recipes, te_weights
from llama_fp8.te_llama import (
    MIN_TE_FP8_PARAMS_FSDP2,
    check_combination,
    check_recipe_supported,
    recipe_spec,
)
from llama_fp8.te_weights import expected_te_shapes, load_hf_checkpoint_into_te, te_state_to_hf


def save_hf(tmp_path: Path, name: str, **kw) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(**{k: v for k, v in kw.items() if k != "max_shard_size"}))
    out = tmp_path / name
    model.save_pretrained(out, max_shard_size=kw.get("max_shard_size", "50GB"))
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    # Every tensor is larger than 1 KB, so each one lands in its own shard.
    return save_hf(tmp_path_factory.mktemp("hf"), "sharded", max_shard_size="1KB")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("hf"), "single")


def zeros_target(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(s) for k, s in expected_te_shapes(cfg).items()}


# --------------------------------------------------------------------------- mapping


def test_sharded_checkpoint_puts_gate_and_up_in_different_shards(sharded):
    hf_dir, _ = sharded
    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    assert (
        weight_map["model.layers.0.mlp.gate_proj.weight"] != weight_map["model.layers.0.mlp.up_proj.weight"]
    )


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_hf_to_te_to_hf_is_exact(layout, request):
    hf_dir, hf_state = request.getfixturevalue(layout)
    target = zeros_target(tiny_config())
    loaded = load_hf_checkpoint_into_te(target, hf_dir)
    assert sorted(loaded) == sorted(hf_state)  # every tensor exactly once
    back = te_state_to_hf(target)
    assert set(back) == set(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name


def test_fc1_is_gate_then_up_and_attention_lands_in_layernorm_qkv(single):
    hf_dir, hf = single
    target = zeros_target(tiny_config())
    load_hf_checkpoint_into_te(target, hf_dir)
    p = "model.layers.1."
    fc1 = target[p + "te_layer.layernorm_mlp.fc1_weight"]
    assert torch.equal(fc1, torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]))
    assert torch.equal(
        target[p + "te_layer.self_attention.layernorm_qkv.key_weight"],
        hf[p + "self_attn.k_proj.weight"],
    )
    assert torch.equal(
        target[p + "te_layer.layernorm_mlp.layer_norm_weight"],
        hf[p + "post_attention_layernorm.weight"],
    )


def test_write_callback_gets_one_call_per_hf_tensor_with_row_slices(sharded):
    hf_dir, hf = sharded
    shapes = {k: torch.empty(s, device="meta") for k, s in expected_te_shapes(tiny_config()).items()}
    calls = []
    load_hf_checkpoint_into_te(shapes, hf_dir, write=lambda key, rows, t: calls.append((key, rows, t.shape)))
    assert len(calls) == len(hf)
    fc1 = [
        (rows, shape)
        for key, rows, shape in calls
        if key == "model.layers.0.te_layer.layernorm_mlp.fc1_weight"
    ]
    assert sorted((r.start, r.stop) for r, _ in fc1) == [(0, 80), (80, 160)]
    assert all(rows is None for key, rows, _ in calls if not key.endswith("fc1_weight"))


def test_tied_embeddings_single_file(tmp_path):
    hf_dir, hf = save_hf(tmp_path, "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(hf_dir / "model.safetensors")
    target = zeros_target(tiny_config(tie_word_embeddings=True))
    target["lm_head.weight"] = target["model.embed_tokens.weight"]  # tied, as in the model
    load_hf_checkpoint_into_te(target, hf_dir)
    back = te_state_to_hf(target, tie_word_embeddings=True)
    assert "lm_head.weight" not in back
    assert torch.equal(back["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor_is_named(single, tmp_path):
    hf_dir = _rewrite(single[0], tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_checkpoint_into_te(zeros_target(tiny_config()), hf_dir)


def test_unexpected_tensor_is_named_and_nothing_is_written(single, tmp_path):
    hf_dir = _rewrite(
        single[0],
        tmp_path / "u",
        lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.ones(2)}),
    )
    target = zeros_target(tiny_config())
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight'"):
        load_hf_checkpoint_into_te(target, hf_dir)
    assert all(not t.any() for t in target.values())  # names are checked before any data is read


def test_checkpoint_with_more_layers_than_model(single):
    target = zeros_target(tiny_config(num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        load_hf_checkpoint_into_te(target, single[0])


def test_shape_mismatch_is_reported(single):
    target = zeros_target(tiny_config())
    target["model.layers.0.te_layer.layernorm_mlp.fc1_weight"] = torch.zeros(2 * 81, 64)
    with pytest.raises(ValueError, match="fc1_weight block 0"):
        load_hf_checkpoint_into_te(target, single[0])


def test_no_checkpoint_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint_into_te({}, tmp_path)


def test_key_functions_reject_unknown_names():
    assert te_weights.hf_to_te_key("model.layers.3.mlp.up_proj.weight") == (
        "model.layers.3.te_layer.layernorm_mlp.fc1_weight",
        1,
    )
    with pytest.raises(ValueError, match="rotary"):
        te_weights.hf_to_te_key("model.rotary.weight")
    with pytest.raises(ValueError, match="unexpected TE key"):
        te_state_to_hf({"model.layers.0.te_layer.foo": torch.zeros(1)})


# --------------------------------------------------------------------------- recipes and versions


@pytest.mark.parametrize(
    ("recipe", "cap", "cuda", "match"),
    [
        ("delayed", (8, 0), "12.4", r"delayed needs compute capability >= 8\.9.*SM 8\.0"),
        ("current", (8, 6), "12.4", r"current needs compute capability >= 8\.9.*SM 8\.6"),
        ("delayed", (8, 9), "12.0", r"CUDA >= 12\.1 on Ada"),
        ("mxfp8", (9, 0), "12.8", r"mxfp8 needs Blackwell.*10\.x.*SM 9\.0"),
        ("mxfp8", (12, 0), "12.8", r"SM 12\.0"),
        ("block", (8, 9), "12.9", r"block needs compute capability >= 9\.0 and CUDA >= 12\.9"),
        ("block", (9, 0), "12.8", r"CUDA >= 12\.9.*CUDA 12\.8"),
        ("delayed", None, None, r"no CUDA device"),
        ("fp4", (10, 0), "12.9", r"'fp4' is not one of delayed, current, mxfp8, block"),
    ],
)
def test_check_recipe_supported_rejects(recipe, cap, cuda, match):
    with pytest.raises(ValueError, match=match):
        check_recipe_supported(recipe, cap, cuda, "2.20.2")


@pytest.mark.parametrize(
    ("recipe", "cap", "cuda"),
    [
        ("delayed", (8, 9), "12.4"),
        ("current", (9, 0), "12.4"),
        ("mxfp8", (10, 0), "12.8"),
        ("block", (9, 0), "12.9"),
        ("block", (10, 0), "13.0"),
    ],
)
def test_check_recipe_supported_accepts(recipe, cap, cuda):
    check_recipe_supported(recipe, cap, cuda, "2.20.2")


def test_recipe_needs_minimum_te_version():
    with pytest.raises(ValueError, match=r"current needs Transformer Engine >= 2\.2, found 2\.1\.0"):
        check_recipe_supported("current", (9, 0), "12.4", "2.1.0")
    check_recipe_supported("block", (9, 0), "12.9", "2.3.0+abc")


def test_check_combination():
    with pytest.raises(ValueError, match=r"delayed cannot be combined with --compile 1"):
        check_combination("delayed", compile=True, fp8_params=False, te_version="2.20.2")
    check_combination("current", compile=True, fp8_params=False, te_version="2.20.2")
    with pytest.raises(ValueError, match=rf">= {MIN_TE_FP8_PARAMS_FSDP2}.*found 2\.9\.0"):
        check_combination("delayed", compile=False, fp8_params=True, te_version="2.9.0")
    with pytest.raises(ValueError, match=r"block under FSDP2 need Transformer Engine >= 2\.14"):
        check_combination("block", compile=False, fp8_params=True, te_version="2.13.0")
    with pytest.raises(ValueError, match="found none"):
        check_combination("mxfp8", compile=False, fp8_params=True, te_version=None)
    check_combination("mxfp8", compile=False, fp8_params=True, te_version="2.10.0.dev0+1a2b")


def test_recipe_spec_plumbs_flags():
    assert recipe_spec("delayed", 16, "most_recent") == (
        "DelayedScaling",
        {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "most_recent"},
    )
    assert recipe_spec("current", 1024, "max") == ("Float8CurrentScaling", {"fp8_format": "HYBRID"})
    assert recipe_spec("mxfp8", 1024, "max") == ("MXFP8BlockScaling", {})
    assert recipe_spec("block", 1024, "max") == ("Float8BlockScaling", {})
    with pytest.raises(ValueError, match="--fp8_amax_compute_algo 'mean' is not one of max, most_recent"):
        recipe_spec("delayed", 16, "mean")
    with pytest.raises(ValueError, match="--fp8_amax_history_len must be >= 1"):
        recipe_spec("delayed", 0, "max")


def test_parse_version():
    assert te_recipes.parse_version("2.10.0.dev0+ab12") == (2, 10, 0)
    assert te_recipes.parse_version("2.9") == (2, 9, 0)
    with pytest.raises(ValueError, match="cannot parse version"):
        te_recipes.parse_version("main")


# --------------------------------------------------------------------------- API selection


def _recorder(calls: list, name: str):
    def fn(**kwargs):
        calls.append((name, kwargs))
        return name

    return fn


def test_autocast_uses_new_api_when_present():
    calls: list = []
    fake = types.SimpleNamespace(autocast=_recorder(calls, "autocast"), fp8_autocast=_recorder(calls, "old"))
    assert te_llama.autocast(True, "R", "G", te_module=fake) == "autocast"
    assert calls == [("autocast", {"enabled": True, "recipe": "R", "amax_reduction_group": "G"})]


def test_autocast_falls_back_to_fp8_autocast():
    calls: list = []
    fake = types.SimpleNamespace(fp8_autocast=_recorder(calls, "fp8_autocast"))
    te_llama.autocast(False, "R", None, te_module=fake)
    assert calls == [("fp8_autocast", {"enabled": False, "fp8_recipe": "R", "fp8_group": None})]
    with pytest.raises(ImportError, match="neither autocast nor fp8_autocast"):
        te_llama.autocast(True, "R", None, te_module=types.SimpleNamespace())


def test_quantized_init_selection():
    calls: list = []
    new = types.SimpleNamespace(
        quantized_model_init=_recorder(calls, "q"), fp8_model_init=_recorder(calls, "f")
    )
    old = types.SimpleNamespace(fp8_model_init=_recorder(calls, "f"))
    te_llama.quantized_init(True, "R", te_module=new)
    te_llama.quantized_init(True, "R", te_module=old)
    assert calls == [
        ("q", {"enabled": True, "recipe": "R"}),
        ("f", {"enabled": True, "recipe": "R"}),
    ]


def test_te_import_error_says_how_to_get_te(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(ImportError, match=r"NGC PyTorch container.*transformer-engine\[pytorch\]"):
        te_llama.te_import()


# --------------------------------------------------------------------------- rope, loss, init


def test_rope_settings_reads_theta_and_rejects_unknown_scaling():
    assert te_llama.rope_settings(tiny_config()) == (500000.0, {})
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        te_llama.rope_settings(tiny_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))


LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


@pytest.mark.parametrize("scaling", [None, LLAMA31_SCALING])
def test_rotary_matches_hf(scaling):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = tiny_config(rope_scaling=scaling, max_position_embeddings=64)
    theta, params = te_llama.rope_settings(cfg)
    hf_rope = LlamaRotaryEmbedding(cfg)
    torch.testing.assert_close(te_llama.rope_inv_freq(16, theta, params), hf_rope.inv_freq)
    x = torch.zeros(1, 32, 64)
    cos, sin = hf_rope(x, torch.arange(32)[None])  # (1, T, head_dim)
    emb = te_llama.LlamaRotary(16, theta, params)(32, torch.device("cpu"))  # (T, 1, 1, head_dim)
    assert emb.shape == (32, 1, 1, 16)
    torch.testing.assert_close(emb[:, 0, 0].cos(), cos[0])
    torch.testing.assert_close(emb[:, 0, 0].sin(), sin[0])


def test_causal_lm_loss_matches_hf():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    ids = torch.randint(0, 96, (2, 12))
    labels = ids.clone()
    labels[0, 3] = -100
    out = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(te_llama.causal_lm_loss(out.logits, labels), out.loss)


def test_init_te_weights_norms_to_one_others_normal():
    model = nn.Module()
    model.attn = nn.Module()
    model.attn.layer_norm_weight = nn.Parameter(torch.zeros(8))
    model.norm = nn.Module()
    model.norm.weight = nn.Parameter(torch.zeros(8))
    model.fc1_weight = nn.Parameter(torch.zeros(400, 50))
    te_llama.init_te_weights(model, std=0.02)
    assert torch.all(model.attn.layer_norm_weight == 1) and torch.all(model.norm.weight == 1)
    assert abs(model.fc1_weight.std().item() - 0.02) < 0.002


# --------------------------------------------------------------------------- build with a fake TE


class FakeTransformerLayer(nn.Module):
    """Stands in for te.TransformerLayer: records kwargs, creates TE-named parameters."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw
        h, f, dev = kw["hidden_size"], kw["ffn_hidden_size"], kw["device"]
        q = kw["num_attention_heads"] * kw["kv_channels"]
        kv = kw["num_gqa_groups"] * kw["kv_channels"]
        self.self_attention = nn.Module()
        self.self_attention.layernorm_qkv = nn.Module()
        qkv = self.self_attention.layernorm_qkv
        for name, shape in [
            ("layer_norm_weight", (h,)),
            ("query_weight", (q, h)),
            ("key_weight", (kv, h)),
            ("value_weight", (kv, h)),
        ]:
            qkv.register_parameter(name, nn.Parameter(torch.empty(shape, device=dev)))
        self.self_attention.proj = nn.Linear(q, h, bias=False, device=dev)
        self.layernorm_mlp = nn.Module()
        for name, shape in [
            ("layer_norm_weight", (h,)),
            ("fc1_weight", (2 * f, h)),
            ("fc2_weight", (h, f)),
        ]:
            self.layernorm_mlp.register_parameter(name, nn.Parameter(torch.empty(shape, device=dev)))
        self.seen_rope: list[tuple[int, ...]] = []

    def forward(self, hidden_states, rotary_pos_emb):
        self.seen_rope.append(tuple(rotary_pos_emb.shape))
        return self.self_attention.proj(hidden_states)  # any (B, T, H) -> (B, T, H) map will do


def test_build_plumbs_config_into_te_layers(monkeypatch):
    monkeypatch.setattr(
        te_llama, "te_import", lambda: types.SimpleNamespace(TransformerLayer=FakeTransformerLayer)
    )
    cfg = tiny_config(rope_scaling=LLAMA31_SCALING)
    with torch.device("meta"):
        model = te_llama.build_te_llama(cfg)
    kw = model.model.layers[1].te_layer.kw
    assert kw["num_gqa_groups"] == 2 and kw["num_attention_heads"] == 4 and kw["kv_channels"] == 16
    assert (kw["normalization"], kw["activation"], kw["attn_input_format"]) == (
        "RMSNorm",
        "swiglu",
        "bshd",
    )
    assert kw["fuse_qkv_params"] is False and kw["bias"] is False and kw["self_attn_mask_type"] == "causal"
    assert kw["hidden_dropout"] == kw["attention_dropout"] == 0.0 and kw["layer_number"] == 2
    assert kw["device"] == "meta" and model.lm_head.weight.is_meta  # a str, as TE compares it
    assert model.model.rotary.theta == 500000.0 and model.model.rotary.scaling["factor"] == 8.0
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == expected_te_shapes(cfg)


def test_build_rejects_unsupported_configs(monkeypatch):
    monkeypatch.setattr(
        te_llama, "te_import", lambda: types.SimpleNamespace(TransformerLayer=FakeTransformerLayer)
    )
    with pytest.raises(ValueError, match="attention_bias=True"):
        te_llama.build_te_llama(tiny_config(attention_bias=True))
    with pytest.raises(ValueError, match="hidden_act silu only"):
        te_llama.build_te_llama(tiny_config(hidden_act="gelu"))


def test_tied_build_shares_embedding(monkeypatch):
    monkeypatch.setattr(
        te_llama, "te_import", lambda: types.SimpleNamespace(TransformerLayer=FakeTransformerLayer)
    )
    with torch.device("meta"):
        model = te_llama.build_te_llama(tiny_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_forward_plumbing_with_fake_layers(monkeypatch):
    monkeypatch.setattr(
        te_llama, "te_import", lambda: types.SimpleNamespace(TransformerLayer=FakeTransformerLayer)
    )
    model = te_llama.build_te_llama(tiny_config(pad_token_id=0))
    assert model.model.embed_tokens.padding_idx == 0
    te_llama.init_te_weights(model, std=0.02)
    ids = torch.randint(0, 96, (2, 12))
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 12, 96) and torch.isfinite(out.loss)
    assert model.model.layers[0].te_layer.seen_rope == [(12, 1, 1, 16)]
    assert model.get_input_embeddings() is model.model.embed_tokens
    assert model.get_output_embeddings() is model.lm_head


def test_rotary_cache_survives_inference_mode():
    rotary = te_llama.LlamaRotary(16, 10000.0)
    with torch.inference_mode():
        rotary(8, torch.device("cpu"))
    assert not rotary(8, torch.device("cpu")).is_inference()


def test_param_attrs_survive_parameter_replacement():
    model = nn.Linear(4, 4, bias=False)
    model.weight.sequence_parallel = True
    attrs = te_llama.save_param_attrs(model)
    model.weight = nn.Parameter(model.weight.detach().clone())  # what fully_shard does, in spirit
    assert not hasattr(model.weight, "sequence_parallel")
    te_llama.restore_param_attrs(model, attrs)
    assert model.weight.sequence_parallel is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_linear_says_it_needs_a_gpu(capsys):
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_linear.py"
    spec = importlib.util.spec_from_file_location("bench_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([]) == 0
    assert "no CUDA GPU visible" in capsys.readouterr().out
