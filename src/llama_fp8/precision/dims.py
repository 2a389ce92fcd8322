"""A block format's dimension rules (``recipes.Dims``), refused before anything is built: every FP8 linear's in
and out features, the tokens of a micro-batch, the sequence and, with FP8 all-gather, the rows of a weight shard
must be multiples of the format's block. A shape that does not divide fails inside the library at the first step
(or, on a GPU kernel, not at all on CPU), so the refusal names the layer, its shape and the rule instead.

``shapes``: (name inside a decoder block, in features, out features) of each GEMM linear, from the model
implementation (``ModelImpl.gemm_shapes``); layers kept in high precision by ``--fp8_exclude`` are not checked.
"""

from __future__ import annotations

from llama_fp8.errors import ConfigError
from llama_fp8.precision import exclude
from llama_fp8.precision.exclude import BLOCKS
from llama_fp8.precision.recipes import Recipe


def problems(cfg, recipe: Recipe, shapes: list[tuple[str, int, int]], patterns: tuple[str, ...],
             world_size: int | None = None) -> list[str]:
    """What breaks ``recipe``'s rules, in words (empty: every shape divides)."""
    d = recipe.dims
    if d is None:
        return []
    out = []
    tp = max(cfg.tp_size, 1)
    if d.features:
        bad: dict[tuple[str, int, int], list[int]] = {}
        for i in range(cfg.num_layers):
            for name, n_in, n_out in shapes:
                if _excluded(f"{BLOCKS}.{i}.{name}", patterns):
                    continue
                if (n_in // tp) % d.features or (n_out // tp) % d.features:
                    bad.setdefault((name, n_in, n_out), []).append(i)
        for (name, n_in, n_out), layers in bad.items():
            where = f"{BLOCKS}.{layers[0]}.{name}" + (f" (and {len(layers) - 1} more blocks)" if len(layers) > 1 else "")
            per = f" per tensor-parallel rank ({n_in // tp} -> {n_out // tp})" if tp > 1 else ""
            out.append(f"{where} is {n_in} -> {n_out}{per}: in and out features must be multiples of {d.features}")
    cp = max(cfg.cp_size, 1)
    seq = cfg.max_context_width // cp
    for flag, batch in (("--train_batch_size", cfg.train_batch_size), ("--val_batch_size", cfg.val_batch_size)):
        if d.tokens and (batch * seq) % d.tokens:
            out.append(f"{flag} {batch} x {seq} tokens{' per context-parallel rank' if cp > 1 else ''} = "
                       f"{batch * seq} tokens per micro-batch: must be a multiple of {d.tokens}")
    if d.sequence and seq % d.sequence:
        out.append(f"--max_context_width {cfg.max_context_width}{f' / --cp_size {cp}' if cp > 1 else ''} = {seq}: "
                   f"the sequence must be a multiple of {d.sequence}")
    if d.shard_rows and cfg.fp8_all_gather and world_size:
        shards = max(world_size // (tp * max(cfg.dp_replicate_size, 1)), 1)
        for name, _, n_out in shapes:
            if n_out % (shards * d.shard_rows):
                out.append(f"--fp8_all_gather 1 shards {BLOCKS}.*.{name} ({n_out} rows) over {shards} ranks: rows "
                           f"per shard must be multiples of {d.shard_rows}")
    return out


def _excluded(name: str, patterns: tuple[str, ...]) -> bool:
    """The layer, or a module that holds it (TE's LayerNormMLP holds fc1 and fc2), matches a --fp8_exclude glob."""
    parts = name.split(".")
    return any(exclude.match(".".join(parts[:i]), patterns) for i in range(len(parts), 2, -1))


def check(cfg, recipe: Recipe, shapes: list[tuple[str, int, int]], patterns: tuple[str, ...],
          world_size: int | None = None) -> None:
    """ConfigError naming each shape that breaks ``recipe``'s rules and what would run instead."""
    found = problems(cfg, recipe, shapes, patterns, world_size)
    if found:
        raise ConfigError(f"--fp8_recipe {recipe.name} ({recipe.backend}, {recipe.format}) cannot quantize this model: "
                          f"{'; '.join(found)} ({recipe.dims.why}). Change the model's dimensions or the batch, keep "
                          f"those layers in BF16 with --fp8_exclude, or use a recipe without this rule "
                          f"(--fp8_recipe tensorwise or current)")
