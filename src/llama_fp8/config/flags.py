"""The command line: ``llama-fp8 train``'s parser (one flag per field, help and choices from the field
metadata, exit 2 with a suggestion for a mistyped flag), ``parse_args`` (defaults < --model preset <
--config FILE.yaml < flags, then ``rules.resolve``) and docs/flags.md's flag table from the same fields."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from dataclasses import fields

from llama_fp8.config.fields import MODEL_FIELDS, TrainConfig
from llama_fp8.config.rules import resolve
from llama_fp8.config.values import (
    _base_type,
    _suggest,
    available_presets,
    choices_of,
    coerce,
    help_of,
    load_preset,
    load_yaml,
)
from llama_fp8.errors import EXIT_BAD_CONFIG


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with a suggestion for a mistyped flag (never parse_known_args)."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        if "unrecognized arguments" in message:
            bad = message.split(":", 1)[1].split()
            names = [a.split("=", 1)[0] for a in bad if a.startswith("-")]
            opts = [o for a in self._actions for o in a.option_strings]
            hints = "".join(f"\n  {n}{_suggest(n, opts)}" for n in names) or f" {' '.join(bad)}"
            message = f"unknown flag(s):{hints}\nsee `{self.prog} --help` for the valid flags"
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_CONFIG, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = "llama-fp8 train") -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                     description="Train a Llama with FSDP2 in BF16 or FP8. Precedence: defaults < --model preset "
                                 "< --config FILE.yaml < flags.",
                     epilog="docs: docs/flags.md")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in fields(TrainConfig):
        g = f.metadata["group"]
        if g not in groups:
            groups[g] = parser.add_argument_group(g)
        default = "" if f.default is None else f" (default: {int(f.default) if isinstance(f.default, bool) else f.default})"
        groups[g].add_argument(f"--{f.name}", type=str, metavar=_metavar(f),
                               help=(help_of(f) + default).replace("%", "%%"))
    return parser


def _metavar(f: dataclasses.Field) -> str:
    if choices_of(f):
        return "{" + ",".join(choices_of(f)) + "}"
    return {bool: "0|1", int: "N", float: "X", dict: "YAML"}.get(_base_type(f), "STR")


def parse_args(argv: list[str]) -> TrainConfig:
    """Flags -> a resolved, validated TrainConfig (raises ConfigError; argparse errors exit 2)."""
    return config_from_flags(vars(build_parser().parse_args(argv)))


def config_from_flags(ns: dict[str, str]) -> TrainConfig:
    """The flag values ``build_parser`` parsed (field name -> text) -> a resolved TrainConfig: the preset, the
    --config YAML, then the flags (a command that adds flags of its own, as ``estimate``, removes them first)."""
    flags = {k: coerce(k, v, f"--{k}") for k, v in ns.items()}
    file_values = load_yaml(flags["config"]) if flags.get("config") else {}
    model = flags.get("model", file_values.get("model", TrainConfig.model))
    values = {**load_preset(model), **file_values, **flags, "model": model}
    return resolve(TrainConfig(**values))


def flag_reference_markdown() -> str:
    """docs/flags.md's flag table, generated from the dataclass so that the two cannot drift."""
    rows, group = [], None
    for f in fields(TrainConfig):
        if f.metadata["group"] != group:
            group = f.metadata["group"]
            rows.append(f"| **{group}** | | |")
        default = f.default if not isinstance(f.default, bool) else int(f.default)
        shown = "preset" if f.name in MODEL_FIELDS else ("-" if default is None else f"`{default}`")
        text = help_of(f).replace("|", "/")
        rows.append(f"| `--{f.name}` | {shown} | {text} |")
    return "\n".join(["| flag | default | what it does |", "|---|---|---|", *rows])


def preset_table_markdown() -> str:
    """docs/flags.md's table of what each preset runs by default (its resolved configuration: the preset file over the
    train defaults), so that the docs say what the defaults are from the files that set them."""
    rows = ["| preset | layers x width (heads / KV heads) | sequence x micro-batch per GPU | activation checkpointing | "
            "peak / final LR |", "|---|---|---|---|---|"]
    for name in available_presets():
        c = parse_args(["--model", name])
        rows.append(f"| `{name}` | {c.num_layers} x {c.hidden_width} ({c.num_heads} / {c.num_key_value_heads}) | "
                    f"{c.max_context_width} x {c.train_batch_size} | {c.activation_checkpointing} | {c.lr:g} / {c.min_lr:g} |")
    return "\n".join(rows)
