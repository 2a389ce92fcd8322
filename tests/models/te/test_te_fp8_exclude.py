"""--fp8_exclude and the FP8 coverage count on the Transformer Engine model: the wrapping and counting on CPU
(modules shaped like TE's, a flag standing in for TE's FP8 state), TE's real FP8 state and kernels on a GPU.

The stand-in sets ``self.fp8`` (and ``forwarded_at_least_once``) in its forward from the (stand-in) autocast
state, as TE's ``prepare_forward`` does through ``init_fp8_metadata`` (transformer_engine/pytorch/module/base.py, TE 2.20): the coverage count
reads that state, what the module itself did, not its name."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch import nn

from llama_fp8.errors import ConfigError
from llama_fp8.models.te.fp8 import coverage as FC
from llama_fp8.precision import verify as V

STATE = {"fp8": True}


@contextlib.contextmanager
def fp8_off():
    old, STATE["fp8"] = STATE["fp8"], False
    try:
        yield
    finally:
        STATE["fp8"] = old


def te_class(name: str):
    """A class named and placed like TE's GEMM modules; forward records whether FP8 was on."""

    class Gemm(nn.Module):
        def __init__(self, i: int, o: int):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(o, i))
            self.saw = None
            self.fp8 = False  # TE: False until a forward runs under FP8 autocast

        def forward(self, x):
            self.saw = self.fp8 = STATE["fp8"]
            self.forwarded_at_least_once = True
            return x @ self.weight.t()

    Gemm.__name__ = name
    Gemm.__module__ = "transformer_engine.pytorch.module." + name.lower()
    return Gemm


def model(n: int = 3) -> nn.Module:
    Linear, LNLinear = te_class("Linear"), te_class("LayerNormLinear")
    layers = nn.ModuleList(nn.Sequential(LNLinear(16, 48), Linear(48, 16)) for _ in range(n))
    m = nn.Module()
    m.model = nn.Module()
    m.model.layers = layers
    m.lm_head = nn.Linear(16, 100, bias=False)
    return m


def run(m: nn.Module) -> None:
    x = torch.zeros(2, 16)
    for layer in m.model.layers:
        x = layer(x)


def test_excluded_te_modules_run_with_fp8_off_and_are_counted():
    m = model()
    wrapped = FC.apply_exclusions(m, ("model.layers.1.*", "model.layers.2.1"), fp8_off)
    assert wrapped == ["model.layers.1.0", "model.layers.1.1", "model.layers.2.1"]
    run(m)
    saw = {f"{i}.{j}": m.model.layers[i][j].saw for i in range(3) for j in range(2)}
    assert saw == {"0.0": True, "0.1": True, "1.0": False, "1.1": False, "2.0": True, "2.1": False}
    assert STATE["fp8"] is True  # restored after each excluded forward
    cov = V.coverage_record(FC.layers(m, ("model.layers.1.*", "model.layers.2.1")))
    assert (cov["fp8_linears"], cov["linears"]) == (3, 7)
    assert cov["high_precision"]["model.layers.1.0"] == "user exception (--fp8_exclude model.layers.1.*)"
    assert cov["high_precision"]["lm_head"] == "output head (not a TE module)"
    gemm = 16 * 48
    assert cov["fp8_flop_share"] == pytest.approx(3 * gemm / (6 * gemm + 1600))
    assert FC.fp8_weights(m) == {"model.layers.0.0.weight", "model.layers.0.1.weight", "model.layers.2.0.weight"}


def test_a_te_layer_whose_forward_ran_without_fp8_is_reported_by_its_own_state():
    """No exclusion, but the step ran outside FP8 autocast (as if the autocast were lost): every TE GEMM says so
    itself, and the check names them."""
    m = model()
    FC.apply_exclusions(m, (), fp8_off)
    assert V.coverage_record(FC.layers(m, ()))["fp8_linears"] == 6  # before any forward: what they are meant to be
    with fp8_off():
        run(m)
    cov = V.coverage_record(FC.layers(m, ()))
    assert (cov["fp8_linears"], cov["linears"]) == (0, 7)
    assert cov["high_precision"]["model.layers.0.0"] == FC.RAN_WITHOUT_FP8
    issues = V.problems(cov, False, None)
    assert issues[0] == "no linear layer runs in FP8 (0/7)"
    assert "6 layer(s) that should run in FP8 do not: model.layers.0.0, model.layers.0.1" in issues[1]
    run(m)  # the next step in FP8: counted again
    assert V.coverage_record(FC.layers(m, ()))["fp8_linears"] == 6


def test_whole_block_glob_wraps_the_block_once():
    m = model()
    assert FC.apply_exclusions(m, ("model.layers.0",), fp8_off) == ["model.layers.0"]
    run(m)
    assert (m.model.layers[0][0].saw, m.model.layers[0][1].saw, m.model.layers[1][0].saw) == (False, False, True)


def test_a_glob_matching_no_te_layer_is_an_error():
    with pytest.raises(ConfigError, match="--fp8_exclude: model.layers.9.\\* matches no FP8-capable layer"):
        FC.apply_exclusions(model(), ("model.layers.9.*",), fp8_off)
    with pytest.raises(ConfigError, match="lm_head"):  # the head is not a TE module: nothing to exclude
        FC.apply_exclusions(model(), ("lm_head",), fp8_off)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with FP8 and Transformer Engine")
def test_te_run_excludes_layers_and_its_fp8_kernels_are_seen(tmp_path):
    """Real TE: an excluded block runs outside FP8 (TE's own FP8 state), the others in FP8, and the one-step
    profile finds FP8 GEMM kernels."""
    from helpers import read_metrics, run_cli

    run_dir = tmp_path / "run"
    r = run_cli(["train", "--model", "tiny", "--model_impl", "te", "--fp8", "1", "--max_steps", "3",
                 "--fp8_exclude", "model.layers.0.*", "--run_dir", str(run_dir)])
    assert r.returncode == 0, r.stderr[-3000:]
    (check,) = [x for x in read_metrics(run_dir) if x["type"] == "fp8_check"]
    assert check["problems"] == [], json.dumps(check)
    # every GEMM kernel is recorded with calls and time; whether their names say FP8 is what this run confirms
    assert check["gemm_kernels"] and all(g["calls"] > 0 and g["ms"] > 0 for g in check["gemm_kernels"])
    assert check["fp8_gemm_kernels"] > 0, json.dumps(check["gemm_kernels"])
    assert all(why.startswith("user exception") or why.startswith("output head")
               for why in check["high_precision"].values())
    assert any(name.startswith("model.layers.0.") for name in check["high_precision"])

