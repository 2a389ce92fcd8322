"""The TE Llama on CPU with a stand-in for ``te.TransformerLayer`` (no TE needed): RoPE against HF's, the
loss, how the config reaches each layer, and the forward plumbing."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from helpers import FakeTransformerLayer, init_te_weights
from helpers import tiny_llama_config as tiny_config
from llama_fp8.models.te import model as te_llama
from llama_fp8.models.te.weights import expected_te_shapes

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
    init_te_weights(model, std=0.02)
    assert torch.all(model.attn.layer_norm_weight == 1) and torch.all(model.norm.weight == 1)
    assert abs(model.fc1_weight.std().item() - 0.02) < 0.002


# --------------------------------------------------------------------------- build with a fake TE


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
    assert kw["fuse_qkv_params"] is True and kw["qkv_weight_interleaved"] is False  # one [q; k; v] weight
    assert kw["bias"] is False and kw["self_attn_mask_type"] == "causal"
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
    init_te_weights(model, std=0.02)
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

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_linear.py"
    spec = importlib.util.spec_from_file_location("bench_linear", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main([]) == 0
    assert "no CUDA GPU visible" in capsys.readouterr().out


# --------------------------------------------------------------------------- values through our build path


class StopForward(Exception):
    """Raised by a forward pre-hook once it has recorded a layer's inputs."""


def record_layer_inputs(layer: nn.Module) -> dict:
    """A forward pre-hook (with kwargs) on ``layer`` that records what reaches it, then stops the call."""
    seen: dict = {}

    def hook(module, args, kwargs):
        seen.update(args=args, kwargs=kwargs)
        raise StopForward

    layer.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.fixture
def gloo_one_rank(one_rank):
    return one_rank


@pytest.mark.parametrize("preset", ["llama3.1-8b", "llama2-7b"])
def test_rotary_angles_reach_te_layers_in_fp32_under_fsdp2_bf16(gloo_one_rank, monkeypatch, preset):
    """Our build path (meta -> fully_shard with the BF16 policy -> to_empty -> init) with a stand-in for
    te.TransformerLayer: the RoPE angles the layer receives are float32 and equal to the FP32 reference at
    every position up to the preset's context length (FSDP2's MixedPrecisionPolicy casts a block's floating
    inputs to BF16 unless told not to: at 4096 positions BF16 rounds the angles to multiples of 16 rad),
    while the hidden states arrive in BF16 like the parameters (TE checks that outside autocast).
    The shape is the preset's (heads, head_dim, theta, llama3 scaling), shrunk in width and depth."""
    from llama_fp8 import config as C
    from llama_fp8 import models, parallel

    monkeypatch.setattr(te_llama, "te_import", lambda: types.SimpleNamespace(TransformerLayer=FakeTransformerLayer))
    full = C.parse_args(["--model", preset])
    head_dim = full.hidden_width // full.num_heads
    cfg = C.parse_args(["--model", preset, "--num_layers", "2", "--hidden_width", str(4 * head_dim),
                        "--num_heads", "4", "--num_key_value_heads", "2", "--intermediate_size", "64",
                        "--vocab_size", "256", "--device", "cpu",
                        "--activation_checkpointing", "none"])  # the 8B preset recomputes: TE's checkpoint, not here
    assert cfg.max_context_width == full.max_context_width >= 4096
    impl = models.get("te")
    with torch.device("meta"):
        model = impl.build(cfg)
    env = parallel.DistEnv(0, 0, 1, 1, torch.device("cpu"))
    parallel.parallelize(model, impl, parallel.build_mesh(parallel.ParallelDims.from_config(cfg, env), env), cfg)
    model.to_empty(device="cpu")
    impl.init_weights(model, cfg, torch.device("cpu"))
    seen = record_layer_inputs(model.model.layers[1].te_layer)
    T = cfg.max_context_width
    with pytest.raises(StopForward), torch.no_grad():
        model(input_ids=torch.zeros(1, T, dtype=torch.long))
    angles = seen["kwargs"]["rotary_pos_emb"]
    theta, scaling = te_llama.rope_settings(models.common.hf_config(cfg))
    want = te_llama.LlamaRotary(head_dim, theta, scaling)._compute(T, torch.device("cpu"))
    assert angles.dtype == torch.float32, angles.dtype
    assert torch.equal(angles, want)
    assert seen["args"][0].dtype == torch.bfloat16  # hidden states, as the BF16 parameters


def test_te_checkpoint_hooks_save_scaling_state_as_tensors_and_never_a_pickle():
    """The hooks of models/te/fp8/state.py on a stand-in TE module (``fp8_meta`` + a pickling
    ``get_extra_state``, as TE's base module): the state dict carries the scales and amax history as
    buffers aliasing fp8_meta's tensors and an empty extra state; loading restores them in place and never
    hands a checkpoint's extra state to the module. (The real TE modules: test_te_real_checkpoint.py.)"""
    from llama_fp8.models.te.fp8 import state as fp8_state

    class FakeTEModule(nn.Module):
        def __init__(self, history: torch.Tensor, scale: torch.Tensor):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))
            self.fp8_meta = {k: types.SimpleNamespace(scale=scale.clone(), amax_history=history.clone())
                             for k in ("scaling_fwd", "scaling_bwd")}
            self.loaded_extra = []

        def get_extra_state(self):  # TE pickles its state here
            return torch.frombuffer(bytearray(b"pickled-state"), dtype=torch.uint8)

        def set_extra_state(self, state):
            self.loaded_extra.append(state)

    saved = FakeTEModule(torch.rand(4, 3), torch.rand(3))
    fresh = FakeTEModule(torch.zeros(4, 3), torch.ones(3))
    for m in (saved, fresh):
        assert fp8_state.keep_pickles_out(m) == 1 and fp8_state.expose_scaling_state(m) == 4
    state = saved.state_dict()
    assert state["_extra_state"].numel() == 0
    assert torch.equal(state["fp8_amax_history_fwd"], saved.fp8_meta["scaling_fwd"].amax_history)
    ptr = fresh.fp8_meta["scaling_bwd"].amax_history.data_ptr()
    fresh.load_state_dict({**state, "_extra_state": torch.tensor([1, 2, 3], dtype=torch.uint8)})
    assert torch.equal(fresh.fp8_meta["scaling_bwd"].amax_history, saved.fp8_meta["scaling_bwd"].amax_history)
    assert fresh.fp8_meta["scaling_bwd"].amax_history.data_ptr() == ptr  # in place
    assert fresh.loaded_extra == [None]


def test_fp8_weight_modules_never_see_a_checkpoints_extra_state():
    """TE 2.20's base module, when its primary weights are FP8, hands the checkpoint's ``_extra_state`` to
    ``set_extra_state`` in its own ``_load_from_state_dict`` before the module's load pre-hooks run
    (transformer_engine/pytorch/module/base.py). The stand-in does the same; loaded through the model's root
    (as the checkpointer does), the module only ever receives None."""
    from llama_fp8.models.te.fp8 import state as fp8_state

    class FakeFp8WeightModule(nn.Module):
        primary_weights_in_fp8 = True

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(2))
            self.fp8_meta = {}
            self.loaded_extra = []

        def get_extra_state(self):
            return torch.frombuffer(bytearray(b"pickled-state"), dtype=torch.uint8)

        def set_extra_state(self, state):
            self.loaded_extra.append(state)

        def _load_from_state_dict(self, state_dict, prefix, *args):
            if self.primary_weights_in_fp8 and prefix + "_extra_state" in state_dict:
                self.set_extra_state(state_dict[prefix + "_extra_state"])
            super()._load_from_state_dict(state_dict, prefix, *args)

    root = nn.Module()
    root.block = nn.Module()
    root.block.gemm = FakeFp8WeightModule()
    assert fp8_state.keep_pickles_out(root) == 1
    state = root.state_dict()
    assert state["block.gemm._extra_state"].numel() == 0
    root.load_state_dict({**state, "block.gemm._extra_state": torch.tensor([1, 2, 3], dtype=torch.uint8)})
    assert root.block.gemm.loaded_extra == [None, None]  # TE's early call and the regular one: None both times


def test_te_model_starts_from_the_hf_models_values(gloo_one_rank, monkeypatch):
    """Audit of the TE init after fully_shard + to_empty: every TE weight, fused ones included, holds exactly
    the values the HF model's init gives the HF tensors it maps to (each block drawn under its HF name), so
    the HF-BF16 vs TE-FP8 comparison starts from one init; norms are ones; matrix stds are the preset's."""
    from llama_fp8 import config as C
    from llama_fp8 import models, parallel
    from llama_fp8.models.common import hf_config
    from llama_fp8.models.te.weights import te_state_to_hf

    monkeypatch.setattr(te_llama, "te_import", lambda: types.SimpleNamespace(TransformerLayer=FakeTransformerLayer))
    cfg = C.parse_args(["--model", "tiny", "--num_layers", "2", "--device", "cpu"])
    env = parallel.DistEnv(0, 0, 1, 1, torch.device("cpu"))
    states = {}
    for name in ("te", "hf"):
        impl = models.get(name)
        with torch.device("meta"):
            model = impl.build(cfg)
        parallel.parallelize(model, impl, parallel.build_mesh(parallel.ParallelDims.from_config(cfg, env), env), cfg)
        impl.materialize(model, torch.device("cpu"), cfg)
        impl.init_weights(model, cfg, torch.device("cpu"))
        states[name] = {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}
    te_as_hf = te_state_to_hf(states["te"], hf_config(cfg))
    assert set(te_as_hf) == set(states["hf"])
    for key, want in states["hf"].items():
        assert torch.equal(te_as_hf[key], want), key
    qkv = states["te"]["model.layers.1.te_layer.self_attention.layernorm_qkv.weight"]
    assert abs(qkv.std().item() - cfg.initializer_range) < 0.05 * cfg.initializer_range


@pytest.mark.parametrize("preset", ["llama3.1-8b", "llama3.2-1b", "llama2-7b"])
def test_rope_equals_hf_bitwise_at_every_position(preset):
    """Audit of the TE model's RoPE: with each preset's theta and (Llama 3.1) llama3 scaling, the angles we
    hand TE give exactly HF's cos and sin (FP32, before any cast) at every position up to the preset's
    max_position_embeddings (131072 for Llama 3.1/3.2), and the inverse frequencies are HF's to the bit."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from llama_fp8 import config as C
    from llama_fp8.models.common import hf_config

    cfg = hf_config(C.parse_args(["--model", preset]))
    theta, scaling = te_llama.rope_settings(cfg)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    hf = LlamaRotaryEmbedding(cfg)
    assert hf.attention_scaling == 1.0  # HF would scale cos/sin otherwise; TE does not
    assert torch.equal(te_llama.rope_inv_freq(head_dim, theta, scaling), hf.inv_freq)
    T = cfg.max_position_embeddings
    cos, sin = hf(torch.zeros(1, T, head_dim), torch.arange(T)[None])
    angles = te_llama.LlamaRotary(head_dim, theta, scaling)(T, torch.device("cpu"))[:, 0, 0]
    assert torch.equal(angles.cos(), cos[0]) and torch.equal(angles.sin(), sin[0])


def test_fp8_amax_reduction_group_is_every_data_parallel_rank(gloo_one_rank, monkeypatch):
    """Audit: TE's delayed-scaling amax reduction runs over the whole world (replicas x shards under HSDP):
    all ranks run the same model, so each FP8 tensor gets one scale everywhere; FP8 weights sharded by FSDP2
    need it (only their FP8 bytes are all-gathered, the scale travels as metadata)."""
    import torch.distributed as dist

    from llama_fp8.models.te.fp8 import precision as te_precision
    from llama_fp8.models.te.fp8 import recipes as te_recipes

    seen = []
    monkeypatch.setattr(te_recipes, "autocast", lambda enabled, recipe, group: seen.append((enabled, group)))
    te_precision.TEFp8("R", all_gather=False, stateful=False).autocast()
    assert seen == [(True, dist.group.WORLD)]


def test_forward_with_targets_is_the_loss_of_the_logits_without_them(monkeypatch):
    """``targets`` (aligned with the inputs): the chunked loss of parallel/loss.py, equal to the cross entropy of
    the logits the forward returns without them, and the same gradients (FP32)."""
    from llama_fp8.parallel.loss import cross_entropy

    monkeypatch.setattr(
        te_llama, "te_import", lambda: types.SimpleNamespace(TransformerLayer=FakeTransformerLayer)
    )
    torch.manual_seed(0)
    model = te_llama.build_te_llama(tiny_config())
    init_te_weights(model, std=0.02)
    ids = torch.randint(0, 96, (2, 12))
    targets = ids.roll(-1, 1)
    targets[:, -1] = -100

    def loss_and_grads(loss_of):
        model.zero_grad()
        loss = loss_of()
        loss.backward()
        return loss.item(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    want = loss_and_grads(lambda: cross_entropy(model(ids).logits, targets))
    out = model(ids, targets=targets)
    assert out.logits is None
    got = loss_and_grads(lambda: model(ids, targets=targets).loss)
    assert abs(got[0] - want[0]) <= 1e-6 * want[0]
    assert sum(g is not None for g in want[1]) >= 4  # the embedding, the stand-in's projections, norm and head
    for g, w in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
