"""Transformer Engine's side of ``--fp8_stats N``: the same per-layer records as the torchao path
(``precision/fp8_stats.py``), taken by TE's own debug API (nvdlfw-inspect, shipped with TE) from the tensors
TE's GEMMs quantize, with TE's own quantizers.

Two TE debug features per layer, every N steps: ``LogFp8TensorStats`` (``underflows%``, ``scale_inv_min`` /
``scale_inv_max``, ``mse`` of the FP8 copy; ``overflows%`` exists for delayed scaling only) and
``LogTensorStats`` (``cur_amax``, ``mean``, ``std`` of the high-precision tensor). A record holds:

- amax: ``cur_amax``; scale: ``1 / scale_inv_max`` (the smallest scale in use, as the torchao records;
  MXFP8 keeps its scales as E8M0 exponent bytes, decoded to ``2^(e - 127)`` first);
- underflow: ``underflows% / 100``. TE counts the elements that were non-zero and became zero over **all**
  elements, the torchao path over the non-zero ones: the same when no element is exactly zero, TE's lower
  otherwise (the record says so: ``underflow_of``). TE logs no count of non-zero elements to convert it;
- saturation: ``overflows% / 100`` (delayed scaling), else None: TE reports no saturation count for the
  other recipes (their scales come from the tensor's own amax);
- snr_db: ``10 log10(E[x^2] / mse)`` with ``E[x^2] = std^2 + mean^2``, the same ratio as the torchao
  path's ``sum x^2 / sum (x - q(x))^2`` (TE's std is the unbiased one: off by a factor (n-1)/n, which for
  the thousands of elements and more of a layer's tensor is far below what the dB figure shows). Over
  several ranks or micro-batches TE 2.20 combines the std with the spread of the groups' means subtracted
  where it belongs added (``stats_computation.compute_variance``): E[x^2] and so the SNR come out low when the
  groups' means differ (pessimistic; activations' and gradients' means are near zero).

The first step of a run (or of a resume) is not logged, as on the torchao path; a validation pass is never
logged (its forward runs with TE's iteration set to one no statistic fires at).

TE reduces activation and gradient statistics over all ranks when ``debug_api.step()`` runs (a collective:
every rank calls it, after every step); weight statistics are of the weight as the GEMM sees it (FSDP2 has
all-gathered it whole).
The debug API must be initialized before the first TE module is built (TE decides at construction whether a
module is inspected), and TE names each inspected layer by its ``name`` attribute: ours are set to the
modules' names in the model, so records and ``--fp8_exclude`` speak the same names.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

from torch import nn

# TE debug tensor -> our record's role; TE's stat names
TENSORS = {"activation": "input", "weight": "weight", "gradient": "grad_output"}
FP8_STATS = ("underflows%", "scale_inv_min", "scale_inv_max", "mse")
HIGH_PRECISION_STATS = ("cur_amax", "mean", "std")  # TE's LogTensorStats has no "variance"
# Our --fp8_recipe names that TE's debug statistics cover, and whether the recipe is HYBRID (E4M3 forward,
# E5M2 gradients: models/te/fp8/recipes.recipe_spec) or E4M3 throughout (TE's MXFP8 and block-scaling defaults)
HYBRID = {"delayed": True, "current": True, "mxfp8": False, "block": False}


def dtypes(recipe: str) -> dict[str, str]:
    """The FP8 format of each TE tensor under ``recipe``."""
    return {t: "float8_e5m2" if HYBRID[recipe] and t == "gradient" else "float8_e4m3fn" for t in TENSORS}


def feature_dir() -> str:
    import transformer_engine

    return os.path.join(os.path.dirname(transformer_engine.__file__), "debug", "features")


def missing_features() -> list[str]:
    """The TE debug features we use that this TE lacks (found by file: importing them needs the debug API
    initialized first)."""
    files = {"LogFp8TensorStats": "log_fp8_tensor_stats.py", "LogTensorStats": "log_tensor_stats.py"}
    return [name for name, f in files.items() if not os.path.isfile(os.path.join(feature_dir(), f))]


def debug_config(every: int, recipe: str, fp8_weights: bool) -> dict:
    """nvdlfw-inspect's configuration: both features on every TE GEMM layer, every ``every`` steps.

    ``overflows%`` only with delayed scaling (TE refuses it for the others, at the first logged step); with FP8
    primary weights (``--fp8_all_gather 1``) the weight has no high-precision copy, so only its scale."""
    if recipe not in HYBRID:
        raise ValueError(f"no TE debug statistics for --fp8_recipe {recipe}; known: {', '.join(HYBRID)}")
    fp8 = [*FP8_STATS, *(["overflows%"] if recipe == "delayed" else [])]

    def per_tensor(stats_of_weight: list[str], stats: list[str]) -> list[dict]:
        return [{"tensor": t, "stats": stats_of_weight if t == "weight" else stats, "freq": every}
                for t in TENSORS]

    weight_fp8 = ["scale_inv_min", "scale_inv_max"] if fp8_weights else fp8
    weight_hp = [] if fp8_weights else list(HIGH_PRECISION_STATS)
    features = {"LogFp8TensorStats": {"enabled": True, "tensors_struct": per_tensor(weight_fp8, fp8)},
                "LogTensorStats": {"enabled": True,
                                   "tensors_struct": [s for s in per_tensor(weight_hp, list(HIGH_PRECISION_STATS))
                                                      if s["stats"]]}}
    return {"llama_fp8_fp8_stats": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
                                    "transformer_engine": features}}


def split_name(metric: str, layers: set[str]) -> tuple[str, str, str] | None:
    """(layer, TE tensor, stat) of a metric name ``{layer}_{tensor}_{stat}``, for one of ``layers`` (a layer's
    own name may hold underscores, so the known names decide where it ends)."""
    for tensor in TENSORS:
        for stat in (*FP8_STATS, "overflows%", *HIGH_PRECISION_STATS):
            tail = f"_{tensor}_{stat}"
            if metric.endswith(tail) and metric[:-len(tail)] in layers:
                return metric[:-len(tail)], tensor, stat
    return None


def e8m0(byte: float) -> float:
    """An MXFP8 scale stored as an E8M0 byte (a biased power-of-two exponent), as a number."""
    return 2.0 ** (byte - 127)


def to_records(values: dict[tuple[str, str], dict[str, float]], step: int, recipe: str) -> list[dict]:
    """Our records (``precision/fp8_stats.tensor_stats``'s fields) from TE's values per (layer, TE tensor)."""
    out, formats = [], dtypes(recipe)
    for (layer, tensor), v in sorted(values.items()):
        if "scale_inv_max" not in v:
            continue  # this tensor was not quantized on this step (a layer outside the FP8 autocast)
        if recipe == "mxfp8":
            v = {**v, "scale_inv_max": e8m0(v["scale_inv_max"])}
        mean_sq = v["std"] ** 2 + v["mean"] ** 2 if "std" in v and "mean" in v else None
        mse = v.get("mse")
        snr = (10 * math.log10(mean_sq / mse) if mse and mse > 0 else None) if mean_sq else None
        out.append({"step": step, "layer": layer, "tensor": TENSORS[tensor], "dtype": formats[tensor],
                    "amax": v.get("cur_amax"),
                    "scale": 1.0 / v["scale_inv_max"] if v["scale_inv_max"] > 0 else None,
                    "underflow": v["underflows%"] / 100 if "underflows%" in v else None, "underflow_of": "all",
                    "saturation": v["overflows%"] / 100 if "overflows%" in v else None,
                    "snr_db": snr})
    return out


def name_layers(model: nn.Module, is_gemm) -> set[str]:
    """Give every TE GEMM module its name in the model (TE labels its statistics with it); the names TE
    will log under (``LayerNormMLP`` logs ``name.fc1`` and ``name.fc2``)."""
    logged = set()
    for name, module in model.named_modules():
        if is_gemm(module):
            module.name = name
            logged.update({f"{name}.fc1", f"{name}.fc2"} if type(module).__name__ == "LayerNormMLP" else {name})
    return logged


class TEStats:
    """The debug API's lifetime in a run: ``start`` before the model is built, ``attach`` once it is (before
    sharding), ``after_step`` after every step on every rank."""

    def __init__(self, every: int, recipe: str, fp8_weights: bool):
        self.every, self.recipe, self.fp8_weights = every, recipe, fp8_weights
        self.layers: set[str] = set()
        self._values: dict[tuple[str, str], dict[str, float]] = {}
        self._api, self._iteration = None, -1  # TE's iteration as last set

    def start(self, log_dir: Path) -> None:
        """Initialize nvdlfw-inspect with TE's features and this object as its statistics logger. Iteration
        -1 until the first step is done: nothing is logged before TE's iteration is our step number."""
        import nvdlfw_inspect.api as debug_api
        from nvdlfw_inspect.logging import BaseLogger

        owner = self

        class _Sink(BaseLogger):
            def log_scalar(self, name, value, iteration, **kwargs):
                owner._take(name, value)

        debug_api.end_debug()  # a run started earlier in this process (tests) must not leave its state
        debug_api.initialize(config_file=debug_config(self.every, self.recipe, self.fp8_weights),
                             feature_dirs=[feature_dir()], statistics_logger=_Sink(), log_dir=str(log_dir),
                             init_training_step=-1)
        self._api = debug_api

    def attach(self, model: nn.Module, is_gemm) -> None:
        self.layers = name_layers(model, is_gemm)

    def _take(self, metric: str, value) -> None:
        parsed = split_name(metric, self.layers)
        if parsed is None:
            return
        layer, tensor, stat = parsed
        self._values.setdefault((layer, tensor), {})[stat] = float(value)

    def after_step(self, step: int) -> list[dict]:
        """Let TE reduce and log what it gathered during ``step`` (every rank), then set its iteration to the
        next step's number (TE decides from it whether a step is logged: ``step % N == 0``). The records of
        ``step``, if it was a logged one."""
        self._api.step()
        self._api.initialize_training_step(step + 1)
        values, self._values = self._values, {}
        self._iteration = step + 1
        return to_records(values, step, self.recipe)

    @contextlib.contextmanager
    def not_logged(self):
        """A forward pass no statistic may see (validation): TE's iteration is -1 meanwhile (before every
        logged step), then what it was."""
        self._api.initialize_training_step(-1)
        try:
            yield
        finally:
            self._api.initialize_training_step(self._iteration)
