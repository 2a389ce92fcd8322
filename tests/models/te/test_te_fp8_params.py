"""FP8 primary weights for the TE model (``--fp8_all_gather 1``), the parts that run on CPU: the modules TE
builds with FP8 weights are materialized through their own ``reset_parameters`` (as TE's FSDP2 path does)
with our sharding-independent init, so they start from the BF16 run's values; every other module is
materialized by ``to_empty``; the combinations TE cannot do are refused before anything is built.

The stand-in below follows the contract of TE's ``TransformerEngineBaseModule.reset_parameters``
(transformer_engine/pytorch/module/base.py): for each parameter, take the DTensor's local shard, allocate
it if it is on meta, run ``param_init_meta[name].init_fn`` on it, quantize (here: nothing), re-wrap it as
a DTensor parameter."""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from llama_fp8.models import common
from llama_fp8.models.te.fp8 import params as fp8_params


class FakeFP8Linear(nn.Module):
    primary_weights_in_fp8 = True

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, device="meta"))
        self.layer_norm_weight = nn.Parameter(torch.empty(cols, device="meta"))
        self.param_init_meta = {n: types.SimpleNamespace(init_fn=None) for n in ("weight", "layer_norm_weight")}

    def reset_parameters(self):
        for name, p in list(self.named_parameters(recurse=False)):
            local = p._local_tensor if isinstance(p, DTensor) else p.data
            if local.is_meta:
                local = torch.empty_like(local, device="cpu")
            self.param_init_meta[name].init_fn(local)
            if isinstance(p, DTensor):
                local = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.size(), stride=p.stride())
            setattr(self, name, nn.Parameter(local))


def model(fp8: bool) -> nn.Module:
    with torch.device("meta"):
        m = nn.Module()
        m.embed = nn.Embedding(600, 16)
        m.block = nn.Module()
        m.block.qkv = FakeFP8Linear(700, 16) if fp8 else nn.Linear(16, 700, bias=False)
        if not fp8:
            m.block.qkv.layer_norm_weight = nn.Parameter(torch.empty(16))
    return m


CFG = types.SimpleNamespace(initializer_range=0.02, seed=3)


def test_fp8_weights_start_from_the_bf16_runs_values(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    fp8, plain = model(fp8=True), model(fp8=False)
    for m in (fp8, plain):
        fully_shard(m.block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    assert fp8_params.materialize(fp8, torch.device("cpu"), CFG) == 1
    plain.to_empty(device="cpu")
    common.init_weights(fp8, CFG, skip=fp8_params.owned(fp8))
    common.init_weights(plain, CFG)
    assert fp8_params.owned(fp8) == {id(fp8.block.qkv.weight), id(fp8.block.qkv.layer_norm_weight)}
    for name in ("embed.weight", "block.qkv.weight", "block.qkv.layer_norm_weight"):
        got, want = fp8.get_parameter(name).full_tensor(), plain.get_parameter(name).full_tensor()
        assert not got.is_meta and torch.equal(got, want), name
    assert torch.all(fp8.block.qkv.layer_norm_weight.full_tensor() == 1)


def test_each_shard_gets_its_own_rows(monkeypatch):
    """A rank holding rows [300, 1000) of a 1000-row FP8 weight gets exactly those rows of the full init."""
    m = FakeFP8Linear(700, 16)
    monkeypatch.setattr(fp8_params, "local_part", lambda p: (p, (300, 0)[:p.dim()], (1000, 16)[:p.dim()]))
    fp8_params.materialize(m, torch.device("cpu"), CFG)
    full = torch.empty(1000, 16)
    common.fill_normal_(full, CFG.initializer_range, CFG.seed, "weight")
    assert torch.equal(m.weight, full[300:])


class QuantizingTELinear(FakeFP8Linear):
    """Named and placed like TE's Linear (so --fp8_exclude can match it), built as under quantized_model_init
    (``primary_weights_in_fp8`` True, a per-instance attribute as TE sets it in __init__); its
    ``reset_parameters`` marks the weight as quantized where TE's would quantize it."""

    def __init__(self, rows: int, cols: int):
        super().__init__(rows, cols)
        self.primary_weights_in_fp8 = True

    def reset_parameters(self):
        super().reset_parameters()
        self.weight.quantized = True


QuantizingTELinear.__name__ = "Linear"
QuantizingTELinear.__module__ = "transformer_engine.pytorch.module.linear"


def te_like_model(fp8: bool) -> nn.Module:
    with torch.device("meta"):
        m = nn.Module()
        m.model = nn.Module()
        m.model.layers = nn.ModuleList()
        for _ in range(2):
            block = nn.Module()
            block.proj = QuantizingTELinear(64, 16) if fp8 else nn.Linear(16, 64, bias=False)
            if not fp8:
                block.proj.layer_norm_weight = nn.Parameter(torch.empty(16))
            m.model.layers.append(block)
    return m


def test_excluded_layers_keep_high_precision_weights_under_fp8_all_gather(one_rank):
    """--fp8_exclude with --fp8_all_gather 1: the whole model is built under TE's quantized init, but an excluded
    layer never runs in FP8, so its weight must not be stored in FP8 (under delayed scaling its scale would stay
    1.0 forever). Its module is materialized and initialized as a BF16 one: the BF16 run's values, a plain
    tensor (all-gathered in BF16), not quantized; the other layer keeps FP8 weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from llama_fp8.models.te.fp8.precision import TEFp8

    mesh = init_device_mesh("cpu", (1,))
    fp8, plain = te_like_model(fp8=True), te_like_model(fp8=False)
    TEFp8(None, all_gather=True, stateful=False, exclude=("model.layers.1.*",)).convert(fp8)
    for m in (fp8, plain):
        for block in m.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    assert fp8_params.materialize(fp8, torch.device("cpu"), CFG) == 1
    plain.to_empty(device="cpu")
    common.init_weights(fp8, CFG, skip=fp8_params.owned(fp8))
    common.init_weights(plain, CFG)
    kept, excluded = fp8.model.layers[0].proj, fp8.model.layers[1].proj
    assert getattr(kept.weight, "quantized", False) and kept.primary_weights_in_fp8
    assert not getattr(excluded.weight, "quantized", False) and not excluded.primary_weights_in_fp8
    for name in ("model.layers.1.proj.weight", "model.layers.1.proj.layer_norm_weight"):
        assert torch.equal(fp8.get_parameter(name).full_tensor(), plain.get_parameter(name).full_tensor()), name
