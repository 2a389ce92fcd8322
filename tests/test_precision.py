"""Precision backends: torchao conversion (filter, recipes, emulation), backend resolution and errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llama_fp8 import config as C
from llama_fp8 import model as M
from llama_fp8 import precision as P

CPU = torch.device("cpu")


def cfg_for(*args: str) -> C.TrainConfig:
    return C.parse_args(["--model", "tiny", *args])


def converted(cfg: C.TrainConfig) -> tuple[nn.Module, P.Precision]:
    prec = P.resolve(cfg, "hf", CPU)
    return prec.convert(M.build_model(cfg, "hf")), prec


def test_fp8_off_is_plain_bf16_or_fp32():
    assert P.resolve(cfg_for(), "hf", CPU).name == "bf16"
    assert P.resolve(cfg_for("--bf16", "0"), "hf", CPU).name == "fp32"
    model, prec = converted(cfg_for())
    assert prec.backend == "none" and not any(type(m).__name__ == "Float8Linear" for m in model.modules())


def test_torchao_converts_every_decoder_linear_but_not_the_head(caplog):
    caplog.set_level("INFO")
    model, prec = converted(cfg_for("--fp8", "1"))
    assert prec.name == "fp8-torchao-tensorwise" and prec.emulated  # CPU: emulated, said so
    f8 = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert len(f8) == 4 * 7 and "lm_head" not in f8
    assert type(model.lm_head) is nn.Linear
    assert "converted 28/29 linears" in caplog.text and "EMULATED" in caplog.text


def test_filter_skips_dims_not_divisible_by_16():
    assert P.fp8_linear_filter(nn.Linear(32, 48, device="meta"), "x")
    assert not P.fp8_linear_filter(nn.Linear(32, 40, device="meta"), "x")
    assert not P.fp8_linear_filter(nn.Linear(24, 48, device="meta"), "x")
    assert not P.fp8_linear_filter(nn.Linear(32, 48, device="meta"), "lm_head")
    assert not P.fp8_linear_filter(nn.LayerNorm(32, device="meta"), "x")


@pytest.mark.parametrize("recipe, granularity", [("tensorwise", "TENSORWISE"), ("rowwise", "AXISWISE")])
def test_fp8_recipe_reaches_torchao(recipe, granularity):
    model, prec = converted(cfg_for("--fp8", "1", "--fp8_recipe", recipe))
    lin = model.model.layers[0].mlp.up_proj
    assert prec.recipe == recipe
    assert lin.config.cast_config_input.scaling_granularity.name == granularity
    assert lin.config.emulate is True


def test_backend_auto_picks_torchao_for_hf_and_te_for_te():
    assert P.resolve(cfg_for("--fp8", "1"), "hf", CPU).backend == "torchao"
    with pytest.raises(C.ConfigError, match="needs a CUDA GPU|--fp8_backend te"):
        P.resolve(cfg_for("--fp8", "1"), "te", CPU)


def test_backend_and_model_impl_mismatch_errors():
    with pytest.raises(C.ConfigError, match="--fp8_backend te needs the Transformer Engine model"):
        P.resolve(cfg_for("--fp8", "1", "--fp8_backend", "te"), "hf", CPU)
    with pytest.raises(C.ConfigError, match="--fp8_backend torchao converts nn.Linear"):
        P.resolve(cfg_for("--fp8", "1", "--fp8_backend", "torchao"), "te", CPU)


def test_emulated_forward_backward_close_to_bf16():
    """One converted layer: FP8 output within FP8's quantization error of the BF16 output."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64)
    seq = nn.Sequential(lin)
    P._torchao_convert(seq, "tensorwise", emulated=True)
    y = seq(x)
    y.sum().backward()
    exact = x @ lin.weight.T
    assert (y - exact).abs().max() / exact.abs().max() < 0.1   # e4m3 has a 3-bit mantissa
    assert not torch.equal(y, exact) and lin.weight.grad is not None


def test_te_backend_plumbs_recipe_flags_and_checks_before_building(monkeypatch):
    """On a (pretended) Hopper with TE, --fp8_recipe/--fp8_amax_* reach TE's recipe; the capability and
    combination checks run first. TE's own classes are replaced by a recorder: no CUDA here."""
    from llama_fp8 import te_llama

    calls = {}
    monkeypatch.setattr(P, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(te_llama, "te_import", lambda: object())
    monkeypatch.setattr(te_llama, "te_version", lambda: "2.8.0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(te_llama, "make_recipe", lambda *a: calls.setdefault("recipe", a))
    cfg = cfg_for("--fp8", "1", "--fp8_backend", "te", "--fp8_recipe", "delayed", "--fp8_amax_history_len", "16",
                  "--fp8_amax_compute_algo", "most_recent")
    prec = P.resolve(cfg, "te", torch.device("cuda", 0))
    assert prec.name == "fp8-te-delayed" and calls["recipe"] == ("delayed", 16, "most_recent")
    assert te_llama.recipe_spec("delayed", 16, "most_recent") == (
        "DelayedScaling", {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "most_recent"})
    with pytest.raises(C.ConfigError, match="delayed cannot be combined with --compile 1"):
        P.resolve(cfg_for("--fp8", "1", "--fp8_backend", "te", "--fp8_recipe", "delayed", "--compile", "1"), "te",
                  torch.device("cuda", 0))
    # auto picks current scaling under torch.compile (TE rejects delayed there)
    assert P.resolve(cfg_for("--fp8", "1", "--compile", "1"), "te", torch.device("cuda", 0)).recipe == "current"
    with pytest.raises(C.ConfigError, match="mxfp8 on NVIDIA H100"):
        P.resolve(cfg_for("--fp8", "1", "--fp8_backend", "te", "--fp8_recipe", "mxfp8"), "te", torch.device("cuda", 0))
