"""The A/B report's predicted-against-measured section (report/prediction_view.py): the prediction for the run's own
GPU when it has published figures, else for an H100 marked not comparable, and why there is none."""

from __future__ import annotations

from pathlib import Path

import pytest

from llama_fp8 import config
from llama_fp8.report import prediction_view
from llama_fp8.report.runs import Run


def run_of(device: str, name: str, recipe: str | None = "tensorwise") -> Run:
    asked = config.asked(config.parse_args(["--model", "llama3.1-8b", "--compile", "1"]))
    resolved = {"model_impl": "hf", "precision": {"recipe": recipe, "backend": "torchao"}}
    return Run("b", Path("b"), "jsonl", [{"step": 1, "loss": 1.0}],
               meta={"device": device, "device_name": name, "model_impl": "hf"},
               config={"asked": asked, "resolved": resolved})


def test_a_run_on_an_h100_is_compared_with_its_prediction():
    p = prediction_view.predicted(run_of("cuda", "NVIDIA H100 80GB HBM3"))
    assert p["gpu"] == "H100" and p["compared"] and p["recipe"] == "tensorwise" and p["speedup"] > 1
    lines = prediction_view.markdown(p, "1.21x, 95 % CI 1.18-1.24, 2 pairs")
    assert "from published figures" in lines[2] and lines[3] == "Measured on NVIDIA H100 80GB HBM3: 1.21x, 95 % CI " \
                                                                 "1.18-1.24, 2 pairs."


@pytest.mark.parametrize("device, name", [("cpu", "cpu"), ("cuda", "NVIDIA A100-SXM4-80GB")])
def test_elsewhere_the_h100_prediction_is_shown_as_not_comparable(device, name):
    p = prediction_view.predicted(run_of(device, name))
    assert p["gpu"] == "H100" and not p["compared"]
    assert "not comparable" in prediction_view.markdown(p, "0.6x")[3]


def test_without_a_recorded_recipe_or_with_a_hostile_config_it_says_why():
    plain = Run("b", Path("b"), "log", [{"step": 1, "loss": 1.0}])
    assert "does not record its model and recipe" in prediction_view.predicted(plain)["why"]
    bad = run_of("cpu", "cpu")
    bad.config["asked"]["hidden_width"] = "wide"
    assert prediction_view.predicted(bad)["why"].startswith("cannot predict from the run's config.yaml (ValueError")
    assert prediction_view.markdown({"why": "x"}, "1x") == ["## Predicted against measured", "", "Not predicted: x.", ""]
