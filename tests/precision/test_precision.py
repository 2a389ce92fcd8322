"""Precision backends: torchao conversion (filter, recipes, emulation), backend resolution and errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from helpers import build_meta
from llama_fp8 import config, models, precision
from llama_fp8.parallel.loss import OutputHead
from llama_fp8.precision import torchao as AO

CPU = torch.device("cpu")
HF, TE = models.get("hf"), models.get("te")


def cfg_for(*args: str) -> config.TrainConfig:
    return config.parse_args(["--model", "tiny", *args])


def converted(cfg: config.TrainConfig) -> tuple[nn.Module, precision.PrecisionChoice]:
    choice = precision.resolve(cfg, HF, CPU)
    return precision.build(choice, HF, cfg).convert(build_meta(cfg)), choice


def test_fp8_off_is_plain_bf16_or_fp32():
    assert precision.resolve(cfg_for(), HF, CPU).name == "bf16"
    assert precision.resolve(cfg_for("--bf16", "0"), HF, CPU).name == "fp32"
    model, prec = converted(cfg_for())
    assert prec.backend == "none" and not any(type(m).__name__ == "Float8Linear" for m in model.modules())


def test_torchao_converts_every_decoder_linear_but_not_the_head(caplog):
    caplog.set_level("INFO")
    model, prec = converted(cfg_for("--fp8", "1"))
    assert prec.name == "fp8-torchao-tensorwise" and prec.emulated  # CPU: emulated, said so
    f8 = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert len(f8) == 4 * 7 and "lm_head" not in f8
    assert type(model.lm_head) is OutputHead  # the head stays in BF16, not converted
    assert "converted 28/29 linears" in caplog.text and "EMULATED" in caplog.text


def test_filter_skips_dims_not_divisible_by_16():
    assert AO.fp8_linear_filter(nn.Linear(32, 48, device="meta"), "x")
    assert not AO.fp8_linear_filter(nn.Linear(32, 40, device="meta"), "x")
    assert not AO.fp8_linear_filter(nn.Linear(24, 48, device="meta"), "x")
    assert not AO.fp8_linear_filter(nn.Linear(32, 48, device="meta"), "lm_head")
    assert not AO.fp8_linear_filter(nn.LayerNorm(32, device="meta"), "x")


@pytest.mark.parametrize("recipe, granularity", [("tensorwise", "TENSORWISE"), ("rowwise", "AXISWISE")])
def test_fp8_recipe_reaches_torchao(recipe, granularity):
    model, prec = converted(cfg_for("--fp8", "1", "--fp8_recipe", recipe))
    lin = model.model.layers[0].mlp.up_proj
    assert prec.recipe == recipe
    assert lin.config.cast_config_input.scaling_granularity.name == granularity
    assert lin.config.emulate is True


def test_backend_auto_picks_torchao_for_hf_and_te_for_te():
    assert precision.resolve(cfg_for("--fp8", "1"), HF, CPU).backend == "torchao"
    with pytest.raises(config.ConfigError, match="needs a CUDA GPU|--fp8_backend te"):
        precision.resolve(cfg_for("--fp8", "1"), TE, CPU)


def test_backend_and_model_impl_mismatch_errors():
    with pytest.raises(config.ConfigError, match="--fp8_backend te does not work with --model_impl hf.*needs --model_impl te"):
        precision.resolve(cfg_for("--fp8", "1", "--fp8_backend", "te"), HF, CPU, others=models.implementations())
    with pytest.raises(config.ConfigError, match="--fp8_backend torchao does not work with --model_impl te.*needs "
                                            "--model_impl hf"):
        precision.resolve(cfg_for("--fp8", "1", "--fp8_backend", "torchao"), TE, CPU, others=models.implementations())


def test_emulated_forward_backward_close_to_bf16():
    """One converted layer: FP8 output within FP8's quantization error of the BF16 output."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64)
    seq = nn.Sequential(lin)
    AO.TorchaoFp8("tensorwise", emulated=True, all_gather=False).convert(seq)
    y = seq(x)
    y.sum().backward()
    exact = x @ lin.weight.T
    assert (y - exact).abs().max() / exact.abs().max() < 0.1   # e4m3 has a 3-bit mantissa
    assert not torch.equal(y, exact) and lin.weight.grad is not None


def test_te_backend_plumbs_recipe_flags_and_checks_before_building(monkeypatch):
    """On a (pretended) Hopper with TE, --fp8_recipe/--fp8_amax_* reach TE's recipe; the capability and
    combination checks run first. TE's own classes are replaced by a recorder: no CUDA here."""
    from llama_fp8.models.te.fp8 import recipes as te_recipes

    calls = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(te_recipes, "te_import", lambda: object())
    monkeypatch.setattr(te_recipes, "te_version", lambda: "2.8.0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(te_recipes, "make_recipe", lambda *a: calls.setdefault("recipe", a))
    cuda = torch.device("cuda", 0)
    cfg = cfg_for("--fp8", "1", "--fp8_backend", "te", "--fp8_recipe", "delayed", "--fp8_amax_history_len", "16",
                  "--fp8_amax_compute_algo", "most_recent")
    choice = precision.resolve(cfg, TE, cuda)
    assert choice.name == "fp8-te-delayed" and choice.emulated is False
    precision.build(choice, TE, cfg)
    assert calls["recipe"] == ("delayed", 16, "most_recent")
    assert te_recipes.recipe_spec("delayed", 16, "most_recent") == (
        "DelayedScaling", {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "most_recent"})
    with pytest.raises(config.ConfigError, match="delayed cannot be combined with --compile 1"):
        precision.resolve(cfg_for("--fp8", "1", "--fp8_backend", "te", "--fp8_recipe", "delayed", "--compile", "1"), TE, cuda)
    # auto picks current scaling (stateless, compile-compatible), with or without torch.compile
    assert precision.resolve(cfg_for("--fp8", "1", "--compile", "1"), TE, cuda).recipe == "current"
    assert precision.resolve(cfg_for("--fp8", "1"), TE, cuda).name == "fp8-te-current"
    with pytest.raises(config.ConfigError, match="mxfp8 on NVIDIA H100"):
        precision.resolve(cfg_for("--fp8", "1", "--fp8_backend", "te", "--fp8_recipe", "mxfp8"), TE, cuda)


def test_te_fp8_parameters_refuse_what_te_cannot_do_before_building(monkeypatch):
    """--fp8_all_gather 1 with the TE model (FP8 primary weights), on a pretended Hopper with TE 2.20."""
    from llama_fp8.models.te.fp8 import recipes as te_recipes

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(te_recipes, "te_import", lambda: object())
    monkeypatch.setattr(te_recipes, "te_version", lambda: "2.20.2")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda, ag = torch.device("cuda", 0), ["--fp8", "1", "--fp8_all_gather", "1"]
    assert precision.resolve(cfg_for(*ag), TE, cuda).all_gather is True  # current scaling: fine
    assert precision.resolve(cfg_for(*ag, "--fp8_recipe", "delayed"), TE, cuda).all_gather is True
    with pytest.raises(config.ConfigError, match="--fp8_recipe block: .*TE's own tests mark it failing.*use "
                                            "--fp8_recipe delayed or current"):
        precision.resolve(cfg_for(*ag, "--fp8_recipe", "block"), TE, cuda)
    with pytest.raises(config.ConfigError, match="works with plain FSDP only"):
        precision.resolve(cfg_for(*ag, "--sharding_strategy", "hybrid"), TE, cuda)
    with pytest.raises(config.ConfigError, match="works with plain FSDP only"):
        precision.resolve(cfg_for(*ag, "--dp_replicate_size", "2"), TE, cuda)
    with pytest.raises(config.ConfigError, match="--init_from_hf with --fp8_all_gather 1"):
        precision.resolve(cfg_for(*ag, "--init_from_hf", "/some/dir"), TE, cuda)
    monkeypatch.setattr(te_recipes, "te_version", lambda: "2.9.0")
    with pytest.raises(config.ConfigError, match=r"need Transformer Engine >= 2\.10 .*found 2\.9\.0"):
        precision.resolve(cfg_for(*ag), TE, cuda)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_te_fp8_parameters_with_activation_checkpointing_are_refused_naming_both_flags(monkeypatch, recipe):
    """FSDP2 re-gathers a resharded block for backward with only TE's transposed FP8 data (Float8Tensor's
    fsdp_pre_all_gather/fsdp_post_all_gather, update_usage on SM < 10); TE's checkpoint then recomputes the
    forward inside backward, which needs the row-wise data: "Cannot generate FP8 data, even from FP8 data
    transpose". Refused when the plan is made, before anything is built; either flag alone is fine."""
    from llama_fp8.models.te.fp8 import recipes as te_recipes

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(te_recipes, "te_import", lambda: object())
    monkeypatch.setattr(te_recipes, "te_version", lambda: "2.20.2")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda, base = torch.device("cuda", 0), ["--fp8", "1", "--fp8_recipe", recipe]
    with pytest.raises(config.ConfigError) as e:
        precision.resolve(cfg_for(*base, "--fp8_all_gather", "1", "--activation_checkpointing", "full"), TE, cuda)
    msg = str(e.value)
    assert "--fp8_all_gather 1" in msg and "--activation_checkpointing full" in msg
    assert "--activation_checkpointing none" in msg and "--fp8_all_gather 0" in msg  # the two ways out
    assert precision.resolve(cfg_for(*base, "--fp8_all_gather", "1"), TE, cuda).all_gather is True
    assert precision.resolve(cfg_for(*base, "--activation_checkpointing", "full"), TE, cuda).all_gather is False


def test_the_recipe_table_is_static_data():
    """Parsing flags needs no backend and no model: the table module imports nothing of this package, and
    every backend's rows (TE's included) are in it."""
    import ast
    import inspect

    from llama_fp8.precision import recipes

    tree = ast.parse(inspect.getsource(recipes))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
               {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("llama_fp8")}, imported
    assert {(r.backend, r.name) for r in recipes.RECIPES} == {
        ("torchao", "tensorwise"), ("torchao", "rowwise"), ("torchao", "mxfp8"), ("torchao", "nvfp4"),
        ("te", "delayed"), ("te", "current"), ("te", "mxfp8"), ("te", "block"), ("te", "nvfp4")}
    assert config.build_parser()._option_string_actions["--fp8_recipe"].metavar == \
        "{auto,tensorwise,rowwise,mxfp8,nvfp4,delayed,current,block}"  # a format's name once, for both backends


def test_auto_recipe_is_decided_by_the_table_for_every_caller(monkeypatch):
    """`--fp8_recipe auto` means the table's default (recipes.default_for), and under --compile 1 a recipe
    that compiles; precision.resolve (the plan) and preflight's FP8 check report the same choice."""
    from llama_fp8.cluster.nodes import preflight
    from llama_fp8.precision import recipes

    assert recipes.default_for("torchao").name == "tensorwise" and recipes.default_for("te").name == "current"
    delayed_default = dataclasses.replace(recipes.get("delayed"), default=True)
    rows = tuple(delayed_default if r.name == "delayed" else dataclasses.replace(r, default=False)
                 if r.backend == "te" else r for r in recipes.RECIPES)
    monkeypatch.setattr(recipes, "RECIPES", rows)
    assert recipes.default_for("te").name == "delayed"
    assert recipes.default_for("te", compile=True).name == "current"  # delayed does not compile under TE
    monkeypatch.setattr(recipes, "RECIPES", recipes.RECIPES[:2] + tuple(
        dataclasses.replace(r, default=r.name == "mxfp8") for r in rows[2:]))
    monkeypatch.setattr(AO.TORCHAO, "library_version", lambda: "0.15.0")
    assert precision.resolve(cfg_for("--fp8", "1"), HF, CPU).recipe == "tensorwise"
    import argparse

    own = argparse.Namespace(device="cpu", model_impl="te", fp8=None, fp8_backend=None, dataset=None,
                             tokenizer=None, checkpoint_dir=None)
    from llama_fp8.models.te.fp8.precision import TE as TE_BACKEND

    monkeypatch.setattr(TE_BACKEND, "library_version", lambda: "2.20.0")
    got = preflight.check_fp8_features(preflight.resolve(own, ["--model", "tiny", "--fp8", "1"]))
    assert (got.status, got.message) == ("OK", "te mxfp8 with transformer_engine 2.20.0")


def test_the_recipe_is_decided_in_one_function_that_config_validation_and_the_resolver_ask(monkeypatch):
    """The recipe decision is precision's (``_choose_recipe``, behind ``resolve``); config validation asks it for
    what the flags settle instead of deciding again, so the two cannot disagree."""
    asked, decide = [], precision._choose_recipe

    def spy(backend, recipe, compile, capability=None):
        asked.append((backend, recipe, compile))
        return decide(backend, recipe, compile, capability)

    monkeypatch.setattr(precision, "_choose_recipe", spy)
    cfg = cfg_for("--fp8", "1", "--fp8_backend", "torchao", "--compile", "1")
    assert asked == [("torchao", "auto", True)]  # config validation asked
    assert precision.resolve(cfg, HF, CPU).recipe == "tensorwise" and asked[1:] == [("torchao", "auto", True)]
    monkeypatch.setattr(precision, "_choose_recipe", lambda *_: (_ for _ in ()).throw(config.ConfigError("no")))
    with pytest.raises(config.ConfigError, match="^no$"):  # so a rule changed there is changed for the parser too
        cfg_for("--fp8", "1", "--fp8_backend", "torchao")


def _runtime_calls(folder) -> set[str]:
    """Methods ``folder``'s code calls on a precision runtime (``prec.x(...)``, ``state.precision.x(...)``; not
    the plan's choice, ``plan.precision``)."""
    import ast

    out = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = node.func.value
            if isinstance(owner, ast.Name) and owner.id == "prec" or (
                    isinstance(owner, ast.Attribute) and owner.attr == "precision"
                    and not (isinstance(owner.value, ast.Attribute) and owner.value.attr == "plan")
                    and not (isinstance(owner.value, ast.Name) and owner.value.id == "plan")):
                out.add(node.func.attr)
    return out


def test_the_runtime_protocol_is_what_training_calls_and_every_runtime_has_it():
    import typing

    from helpers import REPO
    from llama_fp8.models.te.fp8.precision import TEFp8
    from llama_fp8.train.state import TrainState

    declared = {name for name, value in vars(precision.Runtime).items() if callable(value) and name[0] != "_"}
    called = _runtime_calls(REPO / "src" / "llama_fp8" / "train") | _runtime_calls(REPO / "src" / "llama_fp8" /
                                                                                  "estimate")
    assert {"autocast", "post_step", "report", "convert"} <= called, called  # the scan sees the loop's calls
    assert called <= declared, f"called but not in precision.Runtime: {called - declared}"
    for runtime in (precision.Plain, AO.TorchaoFp8, TEFp8):
        assert all(callable(getattr(runtime, name, None)) for name in declared), runtime
    assert typing.get_type_hints(TrainState)["precision"] is precision.Runtime
    assert typing.get_type_hints(precision.build)["return"] is precision.Runtime
