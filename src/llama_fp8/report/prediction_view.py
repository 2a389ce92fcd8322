"""The A/B report's "Predicted against measured": the step-time speed-up ``llama_fp8 estimate`` predicts for the
candidate's recipe from published figures (estimate/predict.py), beside the measured raw speed-up. The prediction is
made for the GPU the runs ran on when it has published figures; runs on a CPU (emulated FP8) or an unknown GPU get
the prediction for the estimate's default GPU, labelled as such and not compared. Communication is left out (the
report does not know the job's layout): the compute-only prediction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llama_fp8.report.runs import Run


def _gpu(run: Run) -> tuple[str | None, str]:
    """(the estimate's GPU name for the run's device, or None; the device's name)."""
    from llama_fp8.estimate import gemm_figures, gpus
    from llama_fp8.telemetry import peaks

    name = str(run.meta.get("device_name") or "unknown")
    if run.meta.get("device") != "cuda":
        return None, name
    peak, _ = peaks.lookup(name)
    key = peak.sku.split()[0] if peak else None
    return (key if key in gpus.GPUS and key in gemm_figures.FIGURES_OF else None), name


def predicted(run: Run) -> dict[str, Any]:
    """{"gpu", "ran_on", "recipe", "speedup", "bound", "line"} for a candidate run, or {"why": ...}."""
    from llama_fp8 import models
    from llama_fp8.errors import ConfigError
    from llama_fp8.estimate import gpus, predict

    asked, resolved = run.config.get("asked"), run.config.get("resolved")
    prec = resolved.get("precision") if isinstance(resolved, dict) else None
    if not isinstance(asked, dict) or not isinstance(prec, dict) or not prec.get("recipe"):
        return {"why": "the run's config.yaml does not record its model and recipe (a plain log or an older version)"}
    gpu, ran_on = _gpu(run)
    try:
        impl = models.get(str(run.meta.get("model_impl") or resolved.get("model_impl")))
        pred = predict.predict([impl], predict.Shapes.of(asked), gpu or gpus.DEFAULT_GPU)
    except (ConfigError, KeyError, TypeError, ValueError, ZeroDivisionError) as e:  # a config.yaml may hold anything
        return {"why": f"cannot predict from the run's config.yaml ({type(e).__name__}: {e})"}
    got = next((r for r in pred.recipes if r.recipe == prec["recipe"]), None)
    if got is None or got.speedup is None:
        return {"why": f"no published figures for recipe {prec['recipe']} on {pred.gpu}"}
    return {"gpu": pred.gpu, "ran_on": ran_on, "compared": gpu is not None, "recipe": prec["recipe"],
            "speedup": got.speedup, "bound": got.bound, "slower": got.slower}


def markdown(p: dict[str, Any], measured_text: str) -> list[str]:
    """The report's section from ``predicted``'s answer and the measured raw speed-up's text."""
    lines = ["## Predicted against measured", ""]
    if "why" in p:
        return lines + [f"Not predicted: {p['why']}.", ""]
    sign = {"<=": "at most ", ">=": "at least "}.get(p["bound"], "")
    lines.append(f"Predicted step-time speed-up of {p['recipe']} over BF16 on {p['gpu']} for this model and batch: "
                 f"**{sign}{p['speedup']:.3g}x**, from published figures (estimate/predict.py, docs/estimate.md; "
                 f"communication left out)" + (f"; expected slower in FP8: {', '.join(p['slower'])}" if p["slower"]
                                               else "") + ".")
    if p["compared"]:
        lines.append(f"Measured on {p['ran_on']}: {measured_text}.")
    else:
        lines.append(f"Measured here: {measured_text}, on {p['ran_on']}: not comparable (no published figures for "
                     f"this device, or FP8 emulated); the prediction stands unchecked until a GPU run of this recipe.")
    return lines + [""]
