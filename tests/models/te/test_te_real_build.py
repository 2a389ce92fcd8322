"""Our own build path on real Transformer Engine modules (``make test-te``): config -> TE model on meta
-> parallelize (TE activation checkpointing, fully_shard per block and root, TE parameter attributes
kept) -> to_empty -> sharded init -> value check; and --init_from_hf through the TE mapping.
Construction only (no forward: that needs a GPU driver, see tests/gpu)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import transformer_engine.pytorch as te  # noqa: F401  (torch first: TE finds libnccl through torch)

from llama_fp8 import config, models, parallel
from llama_fp8.models import common

pytestmark = pytest.mark.te

ARGS = ["--model", "tiny", "--num_layers", "2", "--device", "cpu", "--model_impl", "te"]


TE = models.get("te")


def build_sharded(cfg: config.TrainConfig, env: parallel.DistEnv) -> torch.nn.Module:
    """Our build path (train/build.py) up to the init: meta -> parallelize -> to_empty."""
    with mock.patch.object(torch.cuda, "is_available", return_value=True), torch.device("meta"):
        model = TE.build(cfg)
    mesh = parallel.build_mesh(parallel.ParallelDims.from_config(cfg, env), env)
    parallel.parallelize(model, TE, mesh, cfg)
    model.to_empty(device="cpu")
    return model


def test_build_path_shards_checkpoints_and_initializes_te_layers(one_rank):
    cfg = config.parse_args([*ARGS, "--activation_checkpointing", "full"])
    model = build_sharded(cfg, one_rank)
    from torch.distributed.fsdp import FSDPModule

    layers = TE.decoder_layers(model)
    assert all(isinstance(layer, FSDPModule) for layer in layers) and isinstance(model, FSDPModule)
    assert all(layer.checkpoint_fn is te.checkpoint for layer in layers)   # TE's own activation checkpointing
    TE.init_weights(model, cfg, torch.device("cpu"))
    TE.check_weights(model, cfg)
    size = common.model_size(model, cfg)
    with torch.device("meta"):
        hf = models.get("hf").build(config.parse_args(ARGS[:-2] + ["--model_impl", "hf"]))
    hf_size = common.model_size(hf, cfg)
    assert size.num_params == hf_size.num_params and size.flops_per_token == hf_size.flops_per_token


def test_selective_checkpointing_is_refused_for_te(one_rank):
    cfg = config.parse_args([*ARGS, "--activation_checkpointing", "selective"])
    with pytest.raises(config.ConfigError, match="selective does not work with --model_impl te: the TE model "
                                                 "checkpoints whole blocks"):
        TE.check(cfg, torch.device("cuda", 0))  # the plan's check, before anything is built
    TE.check(config.parse_args([*ARGS, "--activation_checkpointing", "full"]), torch.device("cuda", 0))


def test_init_from_hf_into_sharded_te_model(one_rank, tmp_path):
    from transformers import LlamaForCausalLM

    cfg = config.parse_args(ARGS)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(common.hf_config(cfg))
    hf.save_pretrained(str(tmp_path), max_shard_size="300KB")
    model = build_sharded(cfg, one_rank)
    TE.load_hf(model, str(tmp_path))
    sd = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    fc1 = sd["model.layers.1.te_layer.layernorm_mlp.fc1_weight"]
    gate, up = hf.model.layers[1].mlp.gate_proj.weight, hf.model.layers[1].mlp.up_proj.weight
    assert torch.equal(fc1, torch.cat([gate, up]))      # fc1 = [gate; up], written slice by slice
    assert torch.equal(sd["model.embed_tokens.weight"], hf.model.embed_tokens.weight)


def test_rotary_angles_reach_the_real_te_layer_in_fp32(one_rank):
    """The real te.TransformerLayer, built through our path with the BF16 FSDP2 policy, receives the RoPE
    angles in float32, equal to the FP32 reference at every position up to 4096 (BF16 would round the
    angles there to multiples of 16 rad), and BF16 hidden states. A forward pre-hook records the inputs and
    stops the call before TE's kernels (which need a GPU) run."""
    from llama_fp8.models.te import model as te_llama

    cfg = config.parse_args([*ARGS, "--max_context_width", "4096", "--vocab_size", "256"])
    model = build_sharded(cfg, one_rank)
    TE.init_weights(model, cfg, torch.device("cpu"))
    seen = {}

    class Stop(Exception):
        pass

    def hook(module, args, kwargs):
        seen.update(args=args, kwargs=kwargs)
        raise Stop

    layer = model.model.layers[0].te_layer  # the first TE layer: layer 1 would need layer 0's kernels to run
    assert isinstance(layer, te.TransformerLayer)
    layer.register_forward_pre_hook(hook, with_kwargs=True)
    with pytest.raises(Stop), torch.no_grad():
        model(input_ids=torch.zeros(1, 4096, dtype=torch.long))
    head_dim = cfg.hidden_width // cfg.num_heads
    want = te_llama.LlamaRotary(head_dim, cfg.rope_theta)._compute(4096, torch.device("cpu"))
    assert seen["kwargs"]["rotary_pos_emb"].dtype == torch.float32
    assert torch.equal(seen["kwargs"]["rotary_pos_emb"], want)
    assert seen["args"][0].dtype == torch.bfloat16


def test_te_init_equals_the_hf_init_through_the_mapping(one_rank):
    """Real TE layers (fused QKV) after our sharded init hold exactly the HF model's init, mapped."""
    from llama_fp8.models.common import hf_config
    from llama_fp8.models.te.weights import te_state_to_hf

    cfg = config.parse_args(ARGS)
    te_model = build_sharded(cfg, one_rank)
    TE.init_weights(te_model, cfg, torch.device("cpu"))
    hf_impl = models.get("hf")
    with torch.device("meta"):
        hf = hf_impl.build(cfg)
    hf.to_empty(device="cpu")
    hf_impl.init_weights(hf, cfg, torch.device("cpu"))
    te_state = {k: v.full_tensor() for k, v in te_model.state_dict().items() if hasattr(v, "full_tensor")}
    mapped = te_state_to_hf(te_state, hf_config(cfg))
    for key, want in hf.state_dict().items():
        if key in mapped:
            assert torch.equal(mapped[key], want), key
    assert set(mapped) == {k for k in hf.state_dict() if "rotary" not in k}


def test_excluded_layers_are_built_without_fp8_weights_under_quantized_init(one_rank):
    """--fp8_all_gather 1 --fp8_exclude model.layers.0.*: the real TE model built under TE's quantized_model_init
    (current scaling; TE marks every module for FP8 weights) comes out of the FP8 runtime's convert with block 0's
    modules unmarked (materialized and initialized as BF16 modules: plain weights, all-gathered in BF16) and block
    1's still marked; after sharding block 0's weights are allocated by to_empty as plain FP32 tensors. (TE's
    reset_parameters, which quantizes the other block, needs a GPU.)"""
    from llama_fp8.models.te.fp8 import params as fp8_params
    from llama_fp8.models.te.fp8 import recipes as te_recipes
    from llama_fp8.models.te.fp8.precision import TEFp8

    cfg = config.parse_args([*ARGS, "--fp8", "1", "--fp8_all_gather", "1", "--fp8_exclude", "model.layers.0.*"])
    runtime = TEFp8(te_recipes.make_recipe("current"), all_gather=True, stateful=False, exclude=("model.layers.0.*",))
    with mock.patch.object(torch.cuda, "is_available", return_value=True), torch.device("meta"):
        with runtime.model_init_context():
            model = TE.build(cfg)
    assert {n.split(".")[2] for n, _ in fp8_params.fp8_param_modules(model)} == {"0", "1"}  # TE marked both
    runtime.convert(model)
    marked = [n for n, _ in fp8_params.fp8_param_modules(model)]
    assert marked and all(n.startswith("model.layers.1.") for n in marked), marked
    mesh = parallel.build_mesh(parallel.ParallelDims.from_config(cfg, one_rank), one_rank)
    parallel.parallelize(model, TE, mesh, cfg)
    for name, module in model.named_modules():
        if name.startswith("model.layers.0"):
            module.to_empty(device="cpu", recurse=False)  # what fp8_params.materialize does for them
    weight = model.get_parameter("model.layers.0.te_layer.layernorm_mlp.fc1_weight")
    assert weight.to_local().dtype == torch.float32 and type(weight.to_local()) is torch.Tensor
