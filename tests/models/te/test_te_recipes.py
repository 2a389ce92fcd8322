"""TE's FP8 recipes on CPU, without TE: hardware and version rules (fake GPUs), recipe objects' arguments,
and the selection between TE's old and new APIs (fake TE modules)."""

from __future__ import annotations

import sys
import types

import pytest

from llama_fp8.models.te.fp8 import recipes as te_recipes
from llama_fp8.models.te.fp8.recipes import (
    MIN_TE_FP8_PARAMS_FSDP2,
    check_combination,
    check_recipe_supported,
    recipe_spec,
)

# --------------------------------------------------------------------------- recipes and versions


@pytest.mark.parametrize(
    ("recipe", "cap", "cuda", "match"),
    [
        ("delayed", (8, 0), "12.4", r"delayed needs compute capability >= 8\.9.*SM 8\.0"),
        ("current", (8, 6), "12.4", r"current needs compute capability >= 8\.9.*SM 8\.6"),
        ("delayed", (8, 9), "12.0", r"CUDA >= 12\.1 on compute capability < 9\.0.*SM 8\.9"),
        ("mxfp8", (9, 0), "12.8", r"mxfp8 needs compute capability >= 10\.0.*SM 9\.0"),
        ("mxfp8", (12, 0), "12.8", r">= 10\.0 and < 12\.0.*SM 12\.0"),
        ("block", (8, 9), "12.9", r"block needs compute capability >= 9\.0"),
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
    with pytest.raises(ValueError, match=r"--fp8_recipe block are not offered under FSDP2.*delayed\|current"):
        check_combination("block", compile=False, fp8_params=True, te_version="2.20.2")
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
    assert recipe_spec("nvfp4", 1024, "max") == ("NVFP4BlockScaling", {})  # TE's defaults: RHT, SR, 2-D weights
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
    assert te_recipes.autocast(True, "R", "G", te_module=fake) == "autocast"
    assert calls == [("autocast", {"enabled": True, "recipe": "R", "amax_reduction_group": "G"})]


def test_autocast_falls_back_to_fp8_autocast():
    calls: list = []
    fake = types.SimpleNamespace(fp8_autocast=_recorder(calls, "fp8_autocast"))
    te_recipes.autocast(False, "R", None, te_module=fake)
    assert calls == [("fp8_autocast", {"enabled": False, "fp8_recipe": "R", "fp8_group": None})]
    with pytest.raises(ImportError, match="neither autocast nor fp8_autocast"):
        te_recipes.autocast(True, "R", None, te_module=types.SimpleNamespace())


def test_quantized_init_selection():
    calls: list = []
    new = types.SimpleNamespace(
        quantized_model_init=_recorder(calls, "q"), fp8_model_init=_recorder(calls, "f")
    )
    old = types.SimpleNamespace(fp8_model_init=_recorder(calls, "f"))
    te_recipes.quantized_init(True, "R", te_module=new)
    te_recipes.quantized_init(True, "R", te_module=old)
    assert calls == [
        ("q", {"enabled": True, "recipe": "R"}),
        ("f", {"enabled": True, "recipe": "R"}),
    ]


def test_te_import_error_says_how_to_get_te(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    with pytest.raises(ImportError, match=r"NGC PyTorch container.*transformer-engine\[pytorch\]"):
        te_recipes.te_import()
