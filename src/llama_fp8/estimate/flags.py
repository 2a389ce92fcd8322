"""``llama-fp8 estimate``'s command line: every train flag (the same parser, presets and YAML: any train command
line with ``estimate`` in place of ``train``) plus the cluster the run would get and the GPU it is checked
against. Those few flags are not training settings: ``train`` does not accept them and config.yaml never
holds them."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields

from llama_fp8.config.fields import TrainConfig
from llama_fp8.config.flags import build_parser, config_from_flags
from llama_fp8.errors import ConfigError


def _gpu_names() -> tuple[str, ...]:
    from llama_fp8.estimate import gpus  # the GPU table (imports nothing of the package)

    return gpus.names()


def _opt(default, help: str):
    """A field of EstimateOptions: its default and its flag's one help text."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EstimateOptions:
    """What ``estimate`` adds to the train flags: one field per flag ``--<field>``, its metadata ``help`` the
    flag's help."""

    nodes: int = _opt(1, "nodes the job gets")
    gpus_per_node: int = _opt(None, "GPUs (training processes) per node (default: the --gpu's nodes have: 8, 4 on "
                                    "GB200 and GB300)")
    gpu: str = _opt("H100", "GPU to check against: its memory and its NVLink/network bandwidths")
    gpu_memory_gib: float | None = _opt(None, "memory per GPU in GiB as PyTorch sees it (total_memory; nvidia-smi's "
                                              "memory.total less memory.reserved), for a GPU not in the table "
                                              "(bandwidths stay those of --gpu)")
    suggest: bool = _opt(True, "1: when it does not fit, estimate what would make it fit (each is one more "
                               "estimate)")
    json: bool = _opt(False, "print one JSON object (the same numbers) instead of the report")

    def __post_init__(self):
        if self.gpus_per_node is None:  # the GPU's own nodes (a frozen dataclass: set once, here)
            from llama_fp8.estimate import gpus

            object.__setattr__(self, "gpus_per_node", gpus.GPUS[self.gpu].gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


_OPTIONS = {f.name: f for f in fields(EstimateOptions)}


def _doc(name: str) -> str:
    """``--name``'s help: the field's help and, for a flag that takes a value, its default."""
    f = _OPTIONS[name]
    if f.default is None or name == "json":  # --json takes no value
        return f.metadata["help"]
    default = int(f.default) if isinstance(f.default, bool) else f.default
    return f"{f.metadata['help']} (default: {default})"


def build_estimate_parser() -> argparse.ArgumentParser:
    parser = build_parser(prog="llama-fp8 estimate")
    parser.description = ("Estimate the per-GPU memory and per-step communication of a training run without a "
                          "GPU: the train flags, plus the cluster and the GPU.")
    parser.epilog = "docs: docs/estimate.md"
    g = parser.add_argument_group("estimate (not training settings)")
    g.add_argument("--nodes", type=str, metavar="N", help=_doc("nodes"))
    g.add_argument("--gpus_per_node", type=str, metavar="N", help=_doc("gpus_per_node"))
    g.add_argument("--gpu", type=str, metavar="{" + ",".join(_gpu_names()) + "}", help=_doc("gpu"))
    g.add_argument("--gpu_memory_gib", type=str, metavar="X", help=_doc("gpu_memory_gib"))
    g.add_argument("--suggest", type=str, metavar="0|1", help=_doc("suggest"))
    g.add_argument("--json", action="store_true", help=_doc("json"))
    return parser


def _int(flag: str, text: str, low: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--{flag} {text!r} is not valid; valid: an integer >= {low}") from None
    if value < low:
        raise ConfigError(f"--{flag} {value} is out of range; valid: an integer >= {low}")
    return value


def _options(ns: dict) -> EstimateOptions:
    out = {}
    if "nodes" in ns:
        out["nodes"] = _int("nodes", ns["nodes"])
    if "gpus_per_node" in ns:
        out["gpus_per_node"] = _int("gpus_per_node", ns["gpus_per_node"])
    if "gpu" in ns:
        if ns["gpu"] not in _gpu_names():
            raise ConfigError(f"--gpu {ns['gpu']!r} is not valid; valid: {', '.join(_gpu_names())} (any other GPU: "
                              f"--gpu_memory_gib)")
        out["gpu"] = ns["gpu"]
    if "gpu_memory_gib" in ns:
        try:
            out["gpu_memory_gib"] = float(ns["gpu_memory_gib"])
        except ValueError:
            raise ConfigError(f"--gpu_memory_gib {ns['gpu_memory_gib']!r} is not valid; valid: a number > 0") from None
        if not 0 < out["gpu_memory_gib"] < math.inf:
            raise ConfigError(f"--gpu_memory_gib {ns['gpu_memory_gib']} is out of range; valid: a finite number > 0")
    if "suggest" in ns:
        if ns["suggest"] not in ("0", "1"):
            raise ConfigError(f"--suggest {ns['suggest']!r} is not valid; valid: 0 or 1")
        out["suggest"] = ns["suggest"] == "1"
    if ns.get("json"):
        out["json"] = True
    return EstimateOptions(**out)


ESTIMATE_FLAGS = tuple(f.name for f in fields(EstimateOptions))


def parse_estimate_args(argv: list[str]) -> tuple[TrainConfig, EstimateOptions]:
    """Flags -> (the resolved TrainConfig, exactly as ``train`` would make it; the estimate options). Raises
    ConfigError; argparse errors exit 2."""
    ns = vars(build_estimate_parser().parse_args(argv))
    own = {k: ns.pop(k) for k in ESTIMATE_FLAGS if k in ns}
    return config_from_flags(ns), _options(own)
