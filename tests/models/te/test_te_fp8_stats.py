"""--fp8_stats on the Transformer Engine model: TE's debug-API numbers mapped to our records (values checked
against an independent quantization, and against the torchao path's numbers for the same tensor), the debug
configuration and what is refused; with a real TE install (``make test-te``) the configuration is accepted by
TE's own features and the statistics reach our records through nvdlfw-inspect's logger; on a GPU, a real run."""

from __future__ import annotations

import dataclasses
import json
import math
from unittest import mock

import pytest
import torch

from llama_fp8.errors import ConfigError
from llama_fp8.models.te.fp8 import stats as TS
from llama_fp8.precision import fp8_stats as S


def te_values(x: torch.Tensor, fmax: float = 448.0, dtype=torch.float8_e4m3fn) -> dict[str, float]:
    """What TE's debug API reports for ``x`` under per-tensor current scaling, computed here independently:
    LogTensorStats' cur_amax, mean, std (torch.std: unbiased); LogFp8TensorStats' scale_inv, underflows% (of all
    elements: stats_computation.add_underflows_stats) and mse."""
    amax = x.abs().max()
    scale = fmax / amax
    q = (x * scale).to(dtype).float() / scale
    nonzero = x != 0
    return {"cur_amax": float(amax), "mean": float(x.mean()), "std": float(x.std()),
            "scale_inv_min": float(1 / scale), "scale_inv_max": float(1 / scale),
            "underflows%": 100 * float((nonzero & (q == 0)).sum()) / x.numel(),
            "mse": float(((x - q) ** 2).mean())}


def test_te_numbers_become_the_same_record_as_the_torchao_path_computes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g) * torch.logspace(-8, 1, 48)  # some columns underflow in E4M3
    x[:16] = 0  # exact zeros: TE's underflow share is of all elements, the torchao path's of the non-zero ones
    values = {("model.layers.0.self_attention.layernorm_qkv", "activation"): te_values(x)}
    (rec,) = TS.to_records(values, 7, "current")
    ours = S.tensor_stats(x, S.CastSpec(torch.float8_e4m3fn))
    assert (rec["step"], rec["layer"], rec["tensor"], rec["dtype"]) == (
        7, "model.layers.0.self_attention.layernorm_qkv", "input", "float8_e4m3fn")
    assert rec["amax"] == pytest.approx(ours["amax"]) and rec["scale"] == pytest.approx(ours["scale"], rel=1e-6)
    assert rec["underflow_of"] == "all" and rec["underflow"] > 0.05
    assert rec["underflow"] == pytest.approx(ours["underflow"] * 48 / 64)  # 48 of 64 rows are non-zero
    assert rec["snr_db"] == pytest.approx(ours["snr_db"], rel=1e-4)  # TE's unbiased std: 1/3072 of E[x^2]
    assert rec["saturation"] is None  # TE counts overflows for delayed scaling only


def test_delayed_scaling_overflows_and_fp8_weights_without_a_high_precision_copy():
    values = {("a.b", "gradient"): {"scale_inv_min": 0.5, "scale_inv_max": 0.5, "underflows%": 2.0, "mse": 0.01,
                                    "overflows%": 25.0, "cur_amax": 3.0, "mean": 0.0, "std": 1.0},
              ("a.b", "weight"): {"scale_inv_min": 0.25, "scale_inv_max": 0.25},
              ("a.c", "activation"): {"cur_amax": 1.0, "mean": 0.0, "std": 1.0}}  # not quantized: no record
    grad, weight = TS.to_records(values, 3, "delayed")
    assert (grad["tensor"], grad["dtype"], grad["saturation"], grad["underflow"]) == (
        "grad_output", "float8_e5m2", 0.25, 0.02)
    assert grad["scale"] == 2.0 and grad["snr_db"] == pytest.approx(20.0)  # 10 log10(1 / 0.01)
    assert weight == {"step": 3, "layer": "a.b", "tensor": "weight", "dtype": "float8_e4m3fn", "amax": None,
                      "scale": 4.0, "underflow": None, "underflow_of": "all", "saturation": None, "snr_db": None}
    summary = S.summary([grad, weight], 3)  # a weight without an underflow share does not break the summary
    assert summary["grad_output_underflow_max"] == 0.02 and "weight_underflow_max" not in summary


def test_mxfp8_scales_are_decoded_from_their_e8m0_bytes():
    # TE keeps MXFP8 scale_inv as uint8 E8M0 (a biased exponent); 120 is 2^-7, so the scale is 128
    values = {("a", "activation"): {"scale_inv_min": 118.0, "scale_inv_max": 120.0, "underflows%": 0.0}}
    (rec,) = TS.to_records(values, 1, "mxfp8")
    assert rec["scale"] == 128.0 and TS.e8m0(127) == 1.0
    (current,) = TS.to_records({("a", "activation"): {"scale_inv_max": 0.5}}, 1, "current")
    assert current["scale"] == 2.0


def test_metric_names_split_at_known_layer_names():
    layers = {"model.layers.0.layernorm_mlp.fc1", "model.layers.0.self_attention.layernorm_qkv"}
    assert TS.split_name("model.layers.0.self_attention.layernorm_qkv_activation_underflows%", layers) == (
        "model.layers.0.self_attention.layernorm_qkv", "activation", "underflows%")
    assert TS.split_name("model.layers.0.layernorm_mlp.fc1_gradient_scale_inv_max", layers) == (
        "model.layers.0.layernorm_mlp.fc1", "gradient", "scale_inv_max")
    assert TS.split_name("model.layers.1.layernorm_mlp.fc1_gradient_mse", layers) is None  # not ours
    assert TS.split_name("model.layers.0.layernorm_mlp.fc1_output_mse", layers) is None  # a tensor we do not ask


def test_debug_config_per_recipe_and_for_fp8_weights():
    delayed = TS.debug_config(50, "delayed", fp8_weights=False)["llama_fp8_fp8_stats"]
    assert delayed["layers"] == {"layer_name_regex_pattern": ".*"}
    fp8 = delayed["transformer_engine"]["LogFp8TensorStats"]["tensors_struct"]
    assert [s["tensor"] for s in fp8] == ["activation", "weight", "gradient"] and {s["freq"] for s in fp8} == {50}
    assert all("overflows%" in s["stats"] for s in fp8)
    current = TS.debug_config(1, "current", fp8_weights=True)["llama_fp8_fp8_stats"]["transformer_engine"]
    by_tensor = {s["tensor"]: s["stats"] for s in current["LogFp8TensorStats"]["tensors_struct"]}
    assert "overflows%" not in by_tensor["activation"]  # TE refuses it outside delayed scaling
    assert by_tensor["weight"] == ["scale_inv_min", "scale_inv_max"]  # FP8 primary weights: no copy to compare
    assert [s["tensor"] for s in current["LogTensorStats"]["tensors_struct"]] == ["activation", "gradient"]
    with pytest.raises(ValueError, match="no TE debug statistics for --fp8_recipe nvfp4"):
        TS.debug_config(1, "nvfp4", False)


class FakeDebugApi:
    def __init__(self, sink):
        self.sink, self.iterations, self.pending = sink, [], []

    def step(self):  # TE logs what it gathered during the step when step() is called
        for name, value in self.pending:
            self.sink(name, value)
        self.pending = []

    def initialize_training_step(self, it):
        self.iterations.append(it)


def test_each_step_pins_te_iteration_to_the_next_step_and_labels_records_by_ours():
    stats = TS.TEStats(2, "current", False)
    stats.layers = {"l"}
    stats._api = api = FakeDebugApi(stats._take)
    assert stats.after_step(1) == [] and api.iterations == [2]
    api.pending = [("l_activation_scale_inv_max", torch.tensor(0.5)), ("l_activation_underflows%", 10.0),
                   ("other_activation_mse", 1.0)]
    (rec,) = stats.after_step(2)
    assert (rec["step"], rec["layer"], rec["scale"], rec["underflow"]) == (2, "l", 2.0, 0.1)
    assert api.iterations == [2, 3] and stats.after_step(3) == []
    with stats.not_logged():  # validation after step 3: no statistic fires, then step 4's iteration again
        assert api.iterations[-1] == -1
    assert api.iterations[-2:] == [-1, 4]


def test_the_te_runtime_keeps_validation_out_of_the_statistics(monkeypatch):
    import contextlib

    from llama_fp8.models.te.fp8 import recipes as te_recipes
    from llama_fp8.models.te.fp8.precision import TEFp8

    monkeypatch.setattr(te_recipes, "autocast", lambda *a, **kw: contextlib.nullcontext())
    stats = TS.TEStats(1, "current", False)
    stats._api = api = FakeDebugApi(stats._take)
    runtime = TEFp8(None, False, stateful=False, stats=stats)
    with runtime.autocast():  # a training forward
        assert api.iterations == []
    with torch.no_grad(), runtime.autocast():  # a validation forward
        assert api.iterations == [-1]
    assert api.iterations == [-1, -1]  # back to TE's iteration before (-1 until the first step is done)


def test_the_te_runtime_writes_records_and_a_summary_on_rank_0(tmp_path):
    from llama_fp8.models.te.fp8.precision import TEFp8
    from llama_fp8.telemetry.sinks import MetricsWriter

    stats = TS.TEStats(1, "current", False)
    stats.layers = {"l"}
    stats._api = api = FakeDebugApi(stats._take)
    runtime = TEFp8(None, False, stateful=False, stats=stats)
    runtime.verifier.report = lambda write: None  # the FP8 check has its own tests
    writer = MetricsWriter(tmp_path, enabled=True)
    api.pending = [(f"l_gradient_{k}", v) for k, v in te_values(torch.linspace(-1, 1, 101)).items()]
    runtime.report(writer, 5)
    writer.close()
    (line,) = [json.loads(x) for x in (tmp_path / "fp8_stats.jsonl").read_text().splitlines()]
    assert (line["step"], line["layer"], line["tensor"], line["dtype"]) == (5, "l", "grad_output", "float8_e5m2")
    (summary,) = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
                  if json.loads(x)["type"] == "fp8_stats"]
    assert summary["grad_output_snr_db_min"] == pytest.approx(line["snr_db"])


@pytest.mark.parametrize("extra, recipe, message", [
    (["--compile", "1"], "current", "--fp8_stats with --fp8_backend te and --compile 1: TE's per-layer"),
    ([], "nvfp4", "--fp8_stats with --fp8_recipe nvfp4 on --fp8_backend te: the statistics here read TE's LogFp8TensorStats, "
                  "which covers --fp8_recipe delayed, current, mxfp8, block"),  # TE's NVFP4 has a feature of its own
])
def test_what_te_statistics_cannot_do_is_refused(extra, recipe, message):
    import dataclasses

    from llama_fp8 import config as C
    from llama_fp8.models.te.fp8.precision import check_stats
    from llama_fp8.precision import recipes

    cfg = C.parse_args(["--model", "tiny", "--model_impl", "te", "--fp8", "1", "--fp8_stats", "10", *extra])
    with pytest.raises(ConfigError, match=message.replace("-", "\\-")):
        check_stats(cfg, dataclasses.replace(recipes.get("current"), name=recipe))


# --- with a real Transformer Engine install (make test-te) ------------------------------------------------

@pytest.mark.te
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_accepts_our_configuration_and_its_logger_reaches_our_records(tmp_path, recipe):
    """TE's own features load our configuration and accept every statistic in it for the recipe (they check
    the names only at the first logged step, on a GPU); a statistic TE logs through nvdlfw-inspect's
    MetricLogger reaches our records; TE modules built after the start are inspected, under their names."""
    import nvdlfw_inspect.api as debug_api
    import transformer_engine.pytorch  # noqa: F401 - torch first: TE finds libnccl through torch

    stats = TS.TEStats(3, recipe, False)
    stats.start(tmp_path / "te_debug")
    try:
        check_real_debug_api(stats, recipe)
    finally:
        debug_api.end_debug()  # the other TE tests of this process build their modules without it


def check_real_debug_api(stats, recipe):
    import transformer_engine.pytorch  # noqa: F401
    from nvdlfw_inspect.logging import MetricLogger
    from transformer_engine.debug.features.log_fp8_tensor_stats import LogFp8TensorStats
    from transformer_engine.debug.features.log_tensor_stats import LogTensorStats

    from llama_fp8 import config as C
    from llama_fp8 import models
    from llama_fp8.models.te.fp8 import coverage as fp8_coverage

    te_recipe = {"delayed": "fp8_delayed_scaling", "current": "fp8_current_scaling"}[recipe]
    features = TS.debug_config(3, recipe, False)["llama_fp8_fp8_stats"]["transformer_engine"]
    for spec in features["LogFp8TensorStats"]["tensors_struct"]:
        for stat in spec["stats"]:
            assert LogFp8TensorStats().check_if_stat_is_supported(stat, te_recipe, True)
    for spec in features["LogTensorStats"]["tensors_struct"]:
        assert all(LogTensorStats()._is_supported_stat(stat) for stat in spec["stats"])

    cfg = C.parse_args(["--model", "tiny", "--num_layers", "2", "--device", "cpu", "--model_impl", "te"])
    with mock.patch.object(torch.cuda, "is_available", return_value=True), torch.device("meta"):
        model = models.get("te").build(cfg)
    stats.attach(model, fp8_coverage.is_te_gemm)
    gemms = [m for m in model.modules() if fp8_coverage.is_te_gemm(m)]
    assert gemms and all(m.name == n for n, m in model.named_modules() if fp8_coverage.is_te_gemm(m))
    assert "model.layers.1.te_layer.layernorm_mlp.fc2" in stats.layers
    from transformer_engine.debug.pytorch.debug_state import TEDebugState
    assert TEDebugState.debug_enabled  # the modules were built with the debug API on

    for k, v in te_values(torch.linspace(-2, 2, 33)).items():
        MetricLogger.log_scalar(f"model.layers.1.te_layer.layernorm_mlp.fc2_activation_{k}", torch.tensor(v), 6)
    (rec,) = stats.after_step(6)
    assert (rec["layer"], rec["tensor"], rec["step"]) == ("model.layers.1.te_layer.layernorm_mlp.fc2", "input", 6)
    assert rec["amax"] == 2.0 and rec["scale"] == pytest.approx(224.0)


# --- on a GPU -------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU with FP8 and Transformer Engine")
def test_te_run_writes_per_layer_statistics(tmp_path):
    """Real TE on a GPU: every FP8 GEMM layer (fc1 and fc2 apart) gets a record per tensor on each logged
    step, with sane values, and metrics.jsonl a summary."""
    from helpers import read_metrics, run_cli

    run_dir = tmp_path / "run"
    r = run_cli(["train", "--model", "tiny", "--model_impl", "te", "--fp8", "1", "--fp8_recipe", "current",
                 "--num_layers", "2", "--max_steps", "4", "--fp8_stats", "2", "--run_dir", str(run_dir)])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "fp8_stats.jsonl").read_text().splitlines()]
    assert {x["step"] for x in lines} == {2, 4}
    layers = {x["layer"] for x in lines}
    assert "model.layers.0.te_layer.layernorm_mlp.fc1" in layers and "model.layers.1.te_layer.self_attention.proj" in layers
    assert len(lines) == 2 * len(layers) * 3, sorted(layers)
    for x in lines:
        assert 0 <= x["underflow"] <= 1 and x["amax"] > 0 and x["scale"] > 0, x
        assert x["snr_db"] is not None and math.isfinite(x["snr_db"]) and x["snr_db"] > 10, x
    summaries = [x for x in read_metrics(run_dir) if x["type"] == "fp8_stats"]
    assert [x["step"] for x in summaries] == [2, 4] and summaries[0]["layers"] == len(layers)


@pytest.mark.te
def test_this_te_has_the_features_and_a_te_without_them_is_refused(tmp_path, monkeypatch):
    import transformer_engine.pytorch  # noqa: F401

    from llama_fp8 import config as C
    from llama_fp8.models.te.fp8.precision import check_stats
    from llama_fp8.precision import recipes

    assert TS.missing_features() == []
    monkeypatch.setattr(TS, "feature_dir", lambda: str(tmp_path))
    cfg = C.parse_args(["--model", "tiny", "--model_impl", "te", "--fp8", "1", "--fp8_stats", "10"])
    with pytest.raises(ConfigError, match="has no LogFp8TensorStats / LogTensorStats debug feature"):
        check_stats(cfg, recipes.get("current"))


@pytest.mark.te
def test_the_te_runtime_starts_the_debug_api_before_the_model_is_built(tmp_path):
    import nvdlfw_inspect.api as debug_api
    import transformer_engine.pytorch  # noqa: F401

    from llama_fp8 import config as C
    from llama_fp8 import models
    from llama_fp8 import precision as P

    cfg = C.parse_args(["--model", "tiny", "--model_impl", "te", "--fp8", "1", "--fp8_recipe", "delayed",
                        "--fp8_stats", "5"])
    choice = P.PrecisionChoice("fp8-te-delayed", "te", "delayed", stats_every=5)
    try:
        runtime = P.build(choice, models.get("te"), cfg, tmp_path / "run")
        assert runtime.stats.every == 5 and runtime.stats.recipe == "delayed"
        assert debug_api.DEBUG_MANAGER is not None and (tmp_path / "run" / "te_debug").is_dir()
        off = P.build(dataclasses.replace(choice, stats_every=0), models.get("te"), cfg, tmp_path / "run")
        assert off.stats is None
    finally:
        debug_api.end_debug()
