"""Real-TE structural tier (``pytest -m te tests/te_real``, via ``make test-te``): no GPU needed.

Builds our TE Llama with the real Transformer Engine on ``meta`` and ``cpu`` and checks it against
the HF<->TE mapping, FSDP2 and TE's own rotary class. TE refuses to construct modules without a GPU
("TransformerEngine needs CUDA."), so ``torch.cuda.is_available`` is patched to True only around
construction; CUDA itself is never initialized. Forward passes need a driver and live in tests/gpu.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import transformer_engine.pytorch as te  # torch first: TE finds libnccl through torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import init_te_weights
from helpers import tiny_llama_config as tiny_config
from llama_fp8.models.te import model as te_llama
from llama_fp8.models.te.fp8 import recipes as te_recipes
from llama_fp8.models.te.weights import expected_te_shapes, load_hf_checkpoint_into_te, te_state_to_hf

pytestmark = pytest.mark.te


@contextlib.contextmanager
def pretend_cuda() -> Iterator[None]:
    """TE checks torch.cuda.is_available() in module constructors; nothing else is faked."""
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        yield


def build(device: str, cfg: LlamaConfig) -> torch.nn.Module:
    with pretend_cuda(), torch.device(device):
        return te_llama.build_te_llama(cfg)


def param_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_te_state_dict_matches_mapping(device):
    cfg = tiny_config()
    model = build(device, cfg)
    assert param_shapes(model) == expected_te_shapes(cfg)  # both directions, with shapes
    assert all(p.device.type == device for p in model.parameters())
    layer = model.model.layers[0].te_layer
    assert isinstance(layer, te.TransformerLayer)
    assert layer.self_attention.layernorm_qkv.weight.shape == (64 + 2 * 2 * 16, 64)  # [q; k; v], 2 KV heads
    assert layer.self_attention.qkv_weight_interleaved is False


def test_hf_checkpoint_loads_into_real_te_model_and_exports_back(tmp_path):
    cfg = tiny_config()
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    hf.save_pretrained(tmp_path, max_shard_size="1KB")
    model = build("cpu", cfg)
    load_hf_checkpoint_into_te(model.state_dict(), tmp_path)
    exported = te_state_to_hf(model.state_dict(), cfg)
    expected = hf.state_dict()
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    model.load_state_dict(model.state_dict())  # TE's _extra_state round-trips on CPU


def test_llama3_scaling_and_tied_embeddings_build():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    model = build("meta", tiny_config(rope_scaling=scaling, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.rotary.scaling["factor"] == 8.0


def test_rotary_matches_te_rotary_position_embedding():
    # TE allocates inv_freq on torch.cuda.current_device(); point that at the CPU for this check.
    with mock.patch.object(torch.cuda, "current_device", return_value="cpu"):
        te_rope = te.RotaryPositionEmbedding(16, rotary_base=500000.0)
    expected = te_rope(max_seq_len=32)  # (T, 1, 1, D)
    ours = te_llama.LlamaRotary(16, 500000.0)(32, torch.device("cpu"))
    torch.testing.assert_close(ours, expected)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_world() -> Iterator[None]:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fully_shard_wraps_te_layers_and_init_runs_on_dtensors(gloo_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = build("meta", tiny_config())
    attrs = te_llama.save_param_attrs(model)
    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        te_llama.te_checkpoint_wrap(layer)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    te_llama.restore_param_attrs(model, attrs)
    for name, p in model.named_parameters():
        for key, value in attrs[name].items():
            assert getattr(p, key) == value, (name, key)
    assert model.model.layers[0].checkpoint_fn is te.checkpoint
    model.to_empty(device="cpu")
    init_te_weights(model, std=0.02)
    qkv = model.model.layers[1].te_layer.self_attention.layernorm_qkv
    assert torch.all(qkv.layer_norm_weight.full_tensor() == 1)
    assert abs(qkv.weight.full_tensor().std().item() - 0.02) < 0.005


@pytest.mark.parametrize("name", te_recipes.RECIPES)
def test_make_recipe_builds_each_te_recipe(name):
    from transformer_engine.common import recipe as te_recipe

    obj = te_recipes.make_recipe(name, amax_history_len=16, amax_compute_algo="most_recent")
    cls_name, kwargs = te_recipes.recipe_spec(name, 16, "most_recent")
    assert type(obj) is getattr(te_recipe, cls_name)
    if "fp8_format" in kwargs:
        assert obj.fp8_format == te_recipe.Format.HYBRID
    if name == "delayed":
        assert (obj.amax_history_len, obj.amax_compute_algo) == (16, "most_recent")


def test_the_nvfp4_recipe_object_is_te_s_pretraining_recipe():
    """TE's defaults, as make_recipe builds it: E2M1 values; inputs with a random Hadamard transform and no stochastic
    rounding; weights in 2-D (16x16) blocks; gradients transformed and stochastically rounded (TE's
    common/recipe/__init__.py NVFP4BlockScaling.__post_init__); and the installed TE is new enough for the row."""
    from transformer_engine.common import recipe as te_recipe

    from llama_fp8.precision import recipes

    obj = te_recipes.make_recipe("nvfp4")
    assert type(obj) is te_recipe.NVFP4BlockScaling and obj.fp4_format == te_recipe.Format.E2M1
    assert obj.fp4_quant_fwd_inp.random_hadamard_transform and not obj.fp4_quant_fwd_inp.stochastic_rounding
    assert obj.fp4_quant_fwd_weight.fp4_2d_quantization and not obj.fp4_quant_fwd_weight.random_hadamard_transform
    assert obj.fp4_quant_bwd_grad.random_hadamard_transform and obj.fp4_quant_bwd_grad.stochastic_rounding
    row = recipes.get("nvfp4", "te")
    assert not te_recipes.older(te_recipes.te_version(), row.min_library)
    te_recipes.check_combination("nvfp4", compile=True, fp8_params=True, te_version=te_recipes.te_version())


def test_installed_te_api_selection():
    assert te_recipes.select_autocast(te)[0] == "autocast"  # TE >= 2.9
    assert te_recipes.select_quantized_init(te) == "quantized_model_init"
    version = te_recipes.te_version()
    assert version is not None and te_recipes.parse_version(version) >= (2, 9, 0)
    te_recipes.check_combination("current", compile=False, fp8_params=True, te_version=version)
