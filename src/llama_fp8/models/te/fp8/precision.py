"""Transformer Engine's FP8 as a precision backend (``precision.Fp8Backend``): only with the TE model,
whose layers are TE modules. The loop sees ``autocast()`` around the forward pass and, with
``--fp8_all_gather 1``, a model built under TE's quantized (FP8-parameter) init."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from llama_fp8.errors import ConfigError
from llama_fp8.models.te.fp8 import coverage as fp8_coverage
from llama_fp8.models.te.fp8 import recipes as te_recipes
from llama_fp8.models.te.fp8 import state as fp8_state
from llama_fp8.models.te.fp8 import stats as fp8_stats
from llama_fp8.precision import Plain
from llama_fp8.precision import fp8_stats as shared_stats
from llama_fp8.precision import recipes as recipe_table
from llama_fp8.precision.recipes import Recipe
from llama_fp8.precision.verify import Verifier


class TEBackend:
    name = te_recipes.BACKEND
    recipes = te_recipes.TE_RECIPES
    library = recipe_table.library_of(te_recipes.BACKEND)

    def library_version(self) -> str:
        te_recipes.te_import()
        return te_recipes.te_version() or "unknown"

    def check(self, cfg, recipe: Recipe, device: torch.device, world_size: int) -> bool:
        try:
            te_recipes.te_import()
        except ImportError as e:
            raise ConfigError(f"--fp8_backend {self.name}: {e}") from None
        if device.type != "cuda":
            raise ConfigError(f"--fp8_backend {self.name} needs a CUDA GPU with FP8 (SM >= 8.9); on CPU use "
                              "--model_impl hf --fp8_backend torchao (emulated)")
        capability = torch.cuda.get_device_capability(device)
        version = te_recipes.te_version()
        try:
            te_recipes.check_recipe_supported(recipe.name, capability, torch.version.cuda, version)
        except ValueError as e:
            raise ConfigError(f"--fp8_recipe {recipe.name} on {torch.cuda.get_device_name(device)}: {e}") from None
        self.check_flags(cfg, recipe)  # the flags' own refusals first: theirs say why (block's all-gather: TE's tests fail it)
        try:
            te_recipes.check_combination(recipe.name, cfg.compile, cfg.fp8_all_gather, version)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.fp8_stats:
            check_stats_library()
        return False

    def check_flags(self, cfg, recipe: Recipe) -> None:
        """TE's refusals of the flags alone: the recipe under --compile, FP8 primary weights, --fp8_stats."""
        try:  # FP8 parameters' minimum TE version is the library's question (check): here without it
            te_recipes.check_combination(recipe.name, cfg.compile, False, None)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if cfg.fp8_all_gather:
            check_fp8_parameters(cfg, recipe)
        if cfg.fp8_stats:
            check_stats_flags(cfg, recipe)

    def runtime(self, choice, cfg, run_dir: Path | None = None) -> TEFp8:
        recipe = te_recipes.make_recipe(choice.recipe, cfg.fp8_amax_history_len, cfg.fp8_amax_compute_algo)
        stats = None
        if choice.stats_every:  # before any TE module exists: TE decides at construction what it inspects
            stats = fp8_stats.TEStats(choice.stats_every, choice.recipe, choice.all_gather)
            stats.start((run_dir or Path(".")) / "te_debug")
        return TEFp8(recipe, choice.all_gather, stateful=te_recipes.row(choice.recipe).stateful,
                     exclude=choice.exclude, verify=choice.verify, stats=stats)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def check_stats(cfg, recipe: Recipe) -> None:
    """What TE's debug API (nvdlfw-inspect) needs for --fp8_stats, refused before anything is built."""
    check_stats_flags(cfg, recipe)
    check_stats_library()


def check_stats_flags(cfg, recipe: Recipe) -> None:
    """--fp8_stats' refusals of the flags alone (the recipe, --compile)."""
    if recipe.name not in fp8_stats.HYBRID:
        # TE 2.20 logs NVFP4 through a feature of its own (LogNvfp4TensorStats) that this path does not read yet
        raise ConfigError(f"--fp8_stats with --fp8_recipe {recipe.name} on --fp8_backend te: the statistics here read TE's "
                          f"LogFp8TensorStats, which covers --fp8_recipe {', '.join(fp8_stats.HYBRID)}; use one of "
                          f"them, --fp8_backend torchao (its NVFP4 statistics), or --fp8_stats 0")
    if cfg.compile:
        # On logged steps TE's debug path leaves the compiled graph (te.Linear falls back to eager); how that
        # interacts with our compiled blocks is not verified, so it is not offered.
        raise ConfigError("--fp8_stats with --fp8_backend te and --compile 1: TE's per-layer statistics run its "
                          "layers eagerly on logged steps; use --compile 0 for a run with statistics")


def check_stats_library() -> None:
    """--fp8_stats' needs in the installed libraries: nvdlfw-inspect and the debug features of this TE."""
    try:
        import nvdlfw_inspect.api  # noqa: F401 - a dependency of transformer-engine[pytorch]
    except ImportError as e:
        raise ConfigError(f"--fp8_stats with --fp8_backend te needs nvdlfw-inspect, Transformer Engine's debug API "
                          f"(pip install nvdlfw-inspect; it comes with transformer-engine[pytorch]): {e}") from None
    missing = fp8_stats.missing_features()
    if missing:
        raise ConfigError(f"--fp8_stats with --fp8_backend te: this Transformer Engine ({te_recipes.te_version()}) "
                          f"has no {' / '.join(missing)} debug feature; upgrade it (the statistics were written "
                          f"against TE 2.20) or use --fp8_stats 0")


def check_fp8_parameters(cfg, recipe: Recipe) -> None:
    """What FP8 primary weights (--fp8_all_gather 1) do not support, refused before anything is built."""
    able = [r.name for r in te_recipes.TE_RECIPES if r.fp8_all_gather_since]
    if not recipe.fp8_all_gather_since:  # block
        # TE's own FSDP2 tests mark Float8BlockScaling + FP8 init as failing ("scale inverse padding is not
        # handled correctly during FSDP2 all-gather slice ops",
        # TransformerEngine/tests/pytorch/distributed/run_fsdp2_model.py).
        raise ConfigError(f"--fp8_all_gather 1 with --fp8_recipe block: Transformer Engine's FSDP2 all-gather of "
                          f"blockwise-scaled FP8 weights is not reliable (TE's own tests mark it failing); use "
                          f"--fp8_recipe {' or '.join(a for a in able if a != 'mxfp8')}, or --fp8_all_gather 0")
    if cfg.sharding_strategy == "hybrid" or cfg.dp_replicate_size != 1:
        # TE finds the shard group of a 2-D mesh by the dimension name "shard" (reset_parameters in
        # transformer_engine/pytorch/module/base.py), and its tests mark MXFP8 + FP8 init + HSDP as failing.
        raise ConfigError("--fp8_all_gather 1 with the TE model works with plain FSDP only (one data-parallel "
                          "mesh dimension); drop --sharding_strategy hybrid / --dp_replicate_size, or use "
                          "--fp8_all_gather 0")
    if cfg.activation_checkpointing != "none":
        # FSDP2 re-gathers a resharded block for backward with only the weight's transposed (column-wise) FP8
        # data: TE's Float8Tensor.fsdp_pre_all_gather asks for column-wise usage in PRE_BACKWARD and
        # update_usage drops the row-wise data where FP8 GEMMs need TN layouts (SM < 10; MXFP8 gathers one
        # direction on every GPU). TE's checkpoint then recomputes the forward inside backward, which needs the
        # row-wise data: "Cannot generate FP8 data, even from FP8 data transpose" (TE 2.20; TE's own FSDP2 tests
        # never combine the two). Keeping the blocks unsharded after forward would avoid it, unproven on a GPU.
        raise ConfigError(f"--fp8_all_gather 1 with --activation_checkpointing {cfg.activation_checkpointing} "
                          "(TE): the backward's recomputed forward needs FP8 weight data that FSDP2's backward "
                          "all-gather of TE's FP8 weights does not bring; use --activation_checkpointing none "
                          "(FP8 all-gather, more activation memory) or --fp8_all_gather 0 (activation "
                          "checkpointing, FP8 compute, weights all-gathered in BF16)")
    if cfg.optimizer != "adamw":
        # FP8 weights need FP32 masters in the optimizer (master_weights.py); torchao's low-bit AdamW has none.
        raise ConfigError(f"--optimizer {cfg.optimizer} with --fp8_all_gather 1 (TE): FP8 primary weights are "
                          "optimized by AdamW with FP32 master weights; use --optimizer adamw, or --fp8_all_gather 0")
    if cfg.init_from_hf:
        raise ConfigError("--init_from_hf with --fp8_all_gather 1 (TE): loading a checkpoint into FP8 weights "
                          "is not supported; start the run with --fp8_all_gather 0")


class TEFp8(Plain):
    def __init__(self, recipe, all_gather: bool, stateful: bool, exclude: tuple[str, ...] = (),
                 verify: str = "error", stats: fp8_stats.TEStats | None = None):
        self.recipe, self.all_gather, self.stateful, self.exclude = recipe, all_gather, stateful, exclude
        self.stats = stats
        self.verifier = Verifier(lambda m: fp8_coverage.layers(m, exclude), fp8_coverage.fp8_weights, all_gather,
                                 True, verify)

    def convert(self, model: nn.Module) -> nn.Module:
        """--fp8_exclude: the matching modules run their forward under a nested autocast(enabled=False) and, with
        FP8 weights, keep high-precision weights (built under quantized init, unmarked before materialization)."""
        from llama_fp8.models.te.fp8 import params as fp8_params

        excluded = fp8_coverage.apply_exclusions(model, self.exclude, lambda: te_recipes.autocast(False, self.recipe))
        if self.all_gather:
            fp8_params.keep_high_precision(model, excluded)
        if self.stats is not None:
            self.stats.attach(model, fp8_coverage.is_te_gemm)
        return model

    def post_step(self, model: nn.Module) -> None:
        self.verifier.after_step(model)

    def report(self, writer, step: int) -> None:
        """After each step, on every rank: the FP8 check's record (once) and, with --fp8_stats, TE's statistics
        of the step (gathered over the ranks by TE; written by rank 0)."""
        self.verifier.report(writer.write)
        if self.stats is not None:
            records = self.stats.after_step(step)
            if records and writer.enabled:
                shared_stats.write_records(writer.path.parent, records)
                writer.write(shared_stats.summary(records, step))

    def autocast(self):
        """FP8 autocast for the forward pass only (TE runs backward outside it). The amax reduction group is
        every rank: all of them run the same model (data parallel, replicated or sharded), so they agree on
        each tensor's scale; FP8 weights sharded by FSDP2 even need it (only their FP8 bytes are gathered)."""
        import torch.distributed as dist

        fp8 = te_recipes.autocast(True, self.recipe, dist.group.WORLD if dist.is_initialized() else None)
        if self.stats is not None and not torch.is_grad_enabled():  # validation: not part of a step's statistics
            return _both(self.stats.not_logged(), fp8)
        return fp8

    def prepare(self, model: nn.Module) -> None:
        """After the model is materialized, before a checkpoint is loaded: no TE pickle ever enters or leaves a
        checkpoint, and DelayedScaling's state exists now (not at the first step) as checkpointable tensors."""
        fp8_state.keep_pickles_out(model)
        if self.stateful:
            fp8_state.init_scaling_state(model, self.autocast())
            fp8_state.expose_scaling_state(model)

    def optimizer(self, param_groups: list[dict], **kwargs):
        """FP8 primary weights are optimized through FP32 masters (a weight stored in FP8 would round away
        every update smaller than half its quantization step); BF16/FP32 weights by the configured optimizer."""
        if not self.all_gather:
            return None
        from llama_fp8.models.te.fp8.master_weights import MasterAdamW

        return MasterAdamW(param_groups, **kwargs)

    def model_init_context(self):
        """FP8 primary weights (``--fp8_all_gather 1``): FSDP2 then all-gathers FP8 bytes."""
        if self.all_gather:
            return te_recipes.quantized_init(True, self.recipe)
        return contextlib.nullcontext()


TE = TEBackend()
