"""The FP8 speed-up predicted before a job queues (estimate/predict.py) from published by-shape figures
(estimate/gemm_figures.py): the table lookups, what the model adds up, the layers it names slower, the warnings, and
the estimate's report and JSON that carry it."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from llama_fp8 import config, models
from llama_fp8.estimate import assess, gemm_figures, predict, report
from llama_fp8.estimate.flags import parse_estimate_args

TINY = ["--model", "tiny", "--num_layers", "2", "--max_context_width", "128", "--train_batch_size", "2",
        "--model_impl", "hf"]


@pytest.mark.parametrize("shape, value", [((1024, 1024, 1024), 0.42), ((16384, 4096, 4096), 1.02),
                                          ((16384, 8192, 16384), 1.39), ((32768, 32768, 32768), 1.52),
                                          ((2048, 32768, 32768), 0.99), ((8192, 2048, 8192), 1.01)])
def test_the_rowwise_grid_reads_back_the_published_cells(shape, value):
    fig = gemm_figures.rowwise(*shape)
    assert fig.value == pytest.approx(value) and fig.how == "interpolated" and "pytorch/ao#2312" in fig.source


def test_between_cells_the_grid_interpolates_in_log2_and_beyond_it_says_which_bound():
    mid = gemm_figures.rowwise(16384, 4096, int(round(math.sqrt(4096 * 8192))))  # halfway between N 4096 and 8192
    assert mid.value == pytest.approx((1.02 + 1.20) / 2, abs=1e-3)
    small, large = gemm_figures.rowwise(256, 512, 512), gemm_figures.rowwise(65536, 65536, 65536)
    assert small.value == pytest.approx(0.42) and small.bound == "<=" and "below the table" in small.how
    assert large.value == pytest.approx(1.52) and large.bound == ">="
    assert gemm_figures.rowwise(256, 65536, 1024).bound == "~"  # below in one dimension, above in another


def test_tensorwise_and_te_are_the_published_figures_where_published_and_derived_elsewhere():
    for m, k, n, v in gemm_figures.TENSORWISE_H100:
        assert gemm_figures.lookup("tensorwise", "H100", m, k, n).value == pytest.approx(v)
    ratios = [s / gemm_figures.rowwise(m, k, n).value for m, k, n, _, s in gemm_figures.TE_H100]
    assert gemm_figures.te_ratio() == pytest.approx(math.prod(ratios) ** (1 / 4))
    cur = gemm_figures.lookup("current", "H100", 16384, 4096, 4096)
    assert cur.value == pytest.approx(gemm_figures.lookup("delayed", "H100", 16384, 4096, 4096).value)
    assert "none published for current scaling" in cur.how and "float8_experimental#116" in cur.source
    assert gemm_figures.lookup("rowwise", "H200", 16384, 4096, 4096).value == pytest.approx(1.02)  # H100's figures
    assert gemm_figures.lookup("rowwise", "A100-80GB", 16384, 4096, 4096) is None
    tflops, src = gemm_figures.bf16_tflops("H100", 16384, 8192, 7168)
    assert tflops == pytest.approx(6 * 16384 * 8192 * 7168 / 0.00999977 / 1e12) and "(16384, 8192, 7168)" in src


def shapes(*argv: str) -> predict.Shapes:
    return predict.Shapes.of(config.parse_args(list(argv)))


IMPLS = [models.get("hf"), models.get("te")]


def test_llama31_8b_on_an_h100_gains_from_fp8_and_names_the_kv_projections_slower():
    s = shapes("--model", "llama3.1-8b", "--fp8", "1", "--compile", "1")
    pred = predict.predict(IMPLS, s, "H100", comm_s=0.122)
    by = {r.recipe: r for r in pred.recipes}
    assert set(by) == {"tensorwise", "rowwise", "delayed", "current"}
    assert all(r.speedup > 1 for r in by.values()) and by["tensorwise"].speedup > by["rowwise"].speedup
    assert by["tensorwise"].slower == ["self_attn.k_proj", "self_attn.v_proj"] and by["delayed"].slower == []
    assert by["delayed"].impl == "te" and "te_layer.layernorm_mlp.fc1" in by["delayed"].figures
    # the step is the BF16 parts with the linears replaced: recompute it from the figures
    parts, per_linear = predict.bf16_parts("H100", s, predict.linear_shapes(IMPLS[0], s))
    lin = sum(t / by["rowwise"].figures[n].value for n, t in per_linear.items())
    assert by["rowwise"].speedup == pytest.approx(sum(parts.values()) / (sum(parts.values()) - parts["decoder linears"]
                                                                          + lin))
    text = predict.text(pred, "tensorwise")
    assert "torchao tensorwise" in text and "<- this run" in text.split("torchao tensorwise")[1].split("\n")[0]
    assert ("--fp8_exclude 'model.layers.*.self_attn.k_proj,model.layers.*.self_attn.v_proj'" in text
            and "+25.03 %" in text and "pytorch/ao#2312" in text and "FlashAttention-3" in text)
    assert "WARNING" not in text  # compiled, 16384 tokens per micro-batch


def test_a_small_hidden_size_model_is_predicted_to_lose_with_fp8():
    s = shapes("--model", "tiny", "--hidden_width", "256", "--intermediate_size", "704", "--compile", "1")
    pred = predict.predict(IMPLS, s, "H100")
    assert pred.recipes and all(r.speedup < 1 and r.bound == "<=" for r in pred.recipes), \
        [(r.recipe, r.speedup, r.bound) for r in pred.recipes]
    assert all(len(r.slower) == len(r.figures) for r in pred.recipes)  # every linear slower in FP8
    assert any("micro-batch x sequence = 512 tokens" in w for w in predict.warnings(pred, True))


def test_eager_torchao_is_warned_and_a_gpu_without_figures_gets_no_prediction():
    pred = predict.predict(IMPLS, shapes("--model", "llama3.1-8b"), "H100")
    assert any(w.startswith("torchao without --compile") for w in predict.warnings(pred, True))
    none = predict.predict(IMPLS, shapes("--model", "llama3.1-8b"), "A100-80GB")
    assert none.recipes == [] and "no published by-shape FP8 figures for A100-80GB" in none.why_none
    assert "not predicted" in predict.text(none)


def test_fp8_all_gather_only_matters_when_communication_exceeds_compute():
    s = shapes("--model", "llama3.1-8b", "--compile", "1")
    hidden = predict.predict(IMPLS, s, "H100", comm_s=0.1, all_gather_s=0.05, linear_param_share=0.9,
                             fp8_all_gather=frozenset({"tensorwise"}))
    bound = predict.predict(IMPLS, s, "H100", comm_s=5.0, all_gather_s=2.0, linear_param_share=0.9,
                            fp8_all_gather=frozenset({"tensorwise"}))
    tw = {r.recipe: r for r in bound.recipes}
    assert tw["tensorwise"].step_s == pytest.approx(5.0 - 2.0 * 0.5 * 0.9)  # FP8 all-gather: half the linears' bytes
    assert tw["rowwise"].step_s == pytest.approx(5.0)
    assert {r.recipe: r.speedup for r in hidden.recipes}["rowwise"] > 1
    assert "communication-bound" in predict.text(bound) and "communication-bound" not in predict.text(hidden)


@pytest.mark.slow
def test_the_estimate_prints_and_records_the_prediction_for_fp8_only():
    """One tiny estimate (1 GPU: no communication): its report and JSON carry the prediction; a BF16 run has none."""
    cfg, opts = parse_estimate_args([*TINY, "--fp8", "1", "--gpus_per_node", "1", "--suggest", "0"])
    e = assess.estimate(cfg, opts)
    p = report.to_dict(e)["prediction"]
    assert p["gpu"] == "H100" and p["job_recipe"] == "tensorwise"
    assert {r["recipe"] for r in p["recipes"]} == {"tensorwise", "rowwise", "delayed", "current"}
    assert all(r["speedup"] < 1 for r in p["recipes"])  # 128-token sequences of a tiny model
    text = report.text(e)
    assert "Predicted step-time speed-up of FP8 over BF16 on H100" in text and "<- this run" in text
    json.dumps(p)  # strict JSON
    assert report._prediction(SimpleNamespace(cfg=SimpleNamespace(fp8=False))) is None
