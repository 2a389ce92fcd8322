"""The run plan: every decision of a run, made once before anything is built, then frozen.

``TrainConfig`` is what the user asked; ``RunPlan`` is what will run: the model implementation, the
precision backend and recipe, the device, the mesh, the run and checkpoint folders, the checkpoint to
resume from and the global batch. Every rank makes the same checks (``on_every_rank``: one failing
rank stops all of them with one message); rank 0 decides the folders and the resume point and tells
the others. ``config.yaml`` in the run dir records both halves (``asked:`` and ``resolved:``), so a
run dir says exactly what ran, and ``--config run_dir/config.yaml`` runs the same ask again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from llama_fp8 import checkpoint, models, parallel, precision
from llama_fp8 import config as config_mod
from llama_fp8.config import TrainConfig
from llama_fp8.errors import AgreedError, ConfigError
from llama_fp8.parallel import DistEnv, ParallelDims
from llama_fp8.precision import PrecisionChoice
from llama_fp8.telemetry import goodput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPlan:
    model_impl: str
    precision: PrecisionChoice
    device: str  # "cuda" or "cpu" (each rank's index comes from its local rank)
    world_size: int
    dims: ParallelDims
    run_dir: str
    checkpoint_dir: str
    resume_from: str | None  # a complete step_N folder, or None: start from scratch
    global_batch: int  # sequences per optimizer step: micro-batch x data-parallel ranks x accumulation
    resume_checked: bool = True  # False: the checkpoint this job saved, resumed without the start-up check

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_plan(cfg: TrainConfig, env: DistEnv) -> RunPlan:
    """Check everything that can be checked before building, decide, write config.yaml (rank 0)."""
    impl, choice, dims = parallel.on_every_rank(env, lambda: decide_setup(cfg, env))
    run_dir, ckpt_dir, resume = _agree_on_dirs(cfg, env)
    plan = RunPlan(model_impl=impl.name, precision=choice, device=env.device.type, world_size=env.world_size,
                   dims=dims, run_dir=str(run_dir), checkpoint_dir=str(ckpt_dir),
                   resume_from=None if resume is None else str(resume),
                   global_batch=cfg.train_batch_size * dims.dp_size * cfg.grad_accum_steps)
    plan = checkpoint.check_resume(cfg, env, plan)  # every rank: writable, sound (or the previous one), fits
    if env.is_main:
        write_config(cfg, plan)
        announce(plan.precision)
    return plan


def announce(choice: PrecisionChoice) -> None:
    """The precision decision and why, and what the run should know about it: once, on rank 0 (config.yaml keeps
    the same under ``resolved.precision``)."""
    if choice.backend == "none":
        return
    log.info("precision %s: %s%s", choice.name, choice.reason, f"; {choice.bf16_tail}" if choice.bf16_tail else "")
    for note in choice.notes:
        log.warning("%s", note)


def decide_setup(cfg: TrainConfig, env: DistEnv, impl: models.ModelImpl | None = None, memory_only: bool = False):
    """The checks and choices every rank makes (a missing path or a tokenizer without EOS fails here): (the
    implementation, the precision, the layout). ``impl``: the implementation to check and use (default: what
    ``--model_impl`` resolves to on ``env.device``). ``memory_only`` (``llama_fp8 estimate``, on a machine that is
    not the training node): without the checks of the data, the logging sinks and the device's options, which do
    not change the memory; any other check added here reaches the estimate too."""
    from llama_fp8 import data

    dims = ParallelDims.from_config(cfg, env)
    parallel.check_shapes(cfg, dims)
    if not memory_only:
        try:
            data.validate_data_config(cfg, dims.dp_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_sinks(cfg)
    impl = impl or models.resolve(cfg.model_impl, env.device)
    impl.check(cfg, env.device)
    choice = precision.resolve(cfg, impl, env.device, env.world_size, models.implementations())
    if not memory_only:
        check_device_options(cfg, env)
    return impl, choice, dims


# flag -> (modules it imports, what to name, the extra that installs them)
SINK_PACKAGES = {
    "tensorboard_dir": (("tensorboard",), "tensorboard", "tensorboard"),
    "wandb_project": (("wandb",), "wandb", "wandb"),
    "prometheus_textfile_dir": (("prometheus_client",), "prometheus_client", "prometheus"),
    "mlflow_tracking_uri": (("mlflow",), "mlflow", "mlflow"),
    "otlp_endpoint": (("opentelemetry.sdk.metrics", "opentelemetry.exporter.otlp.proto.http.metric_exporter"),
                      "opentelemetry-sdk and its OTLP/HTTP exporter", "otlp"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a dotted name whose parent package is missing
        return False


def check_sinks(cfg: TrainConfig) -> None:
    """The optional metrics sinks asked for can start: their packages are installed, the textfile folder is writable,
    the OTLP endpoint is a URL (checked before training, on every rank: each node has its own folder)."""
    from llama_fp8.telemetry import otlp, prometheus

    for flag, (modules, what, extra) in SINK_PACKAGES.items():
        if getattr(cfg, flag) and not all(map(_installed, modules)):
            raise ConfigError(f"--{flag} needs {what}: pip install 'llama-fp8[{extra}]'")
    if cfg.prometheus_textfile_dir and (problem := prometheus.check_dir(cfg.prometheus_textfile_dir)):
        raise ConfigError(f"--prometheus_textfile_dir {cfg.prometheus_textfile_dir} {problem}")
    if cfg.otlp_endpoint:
        try:
            otlp.endpoint_url(cfg.otlp_endpoint)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_device_options(cfg: TrainConfig, env: DistEnv) -> None:
    """Options that need CUDA say so on CPU instead of failing deep inside a library."""
    if env.device.type == "cuda":
        return
    if cfg.cpu_offload:
        raise ConfigError("--cpu_offload 1 moves parameters between GPU and host memory and needs CUDA; on CPU "
                          "they are in host memory already: drop it")
    if cfg.memory_snapshot:
        raise ConfigError("--memory_snapshot 1 records CUDA memory history and needs CUDA; on CPU the log line "
                          "reports the peak resident memory")
    if cfg.optimizer == "adamw_fp8":
        raise ConfigError("--optimizer adamw_fp8 needs CUDA (torchao's FP8 optimizer states have no CPU kernels); "
                          "on CPU use --optimizer adamw8bit")
    if cfg.optimizer != "adamw" and importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"--optimizer {cfg.optimizer} needs torchao: pip install 'llama-fp8[torchao]'")


def _agree_on_dirs(cfg: TrainConfig, env: DistEnv) -> tuple[Path, Path, Path | None]:
    """Rank 0 picks the run dir, the checkpoint dir and the checkpoint to resume from; every rank learns
    the same answer or the same error."""
    out: list = [None]
    if env.is_main:
        try:
            out[0] = decide_dirs(cfg)
        except ValueError as e:  # ConfigError included
            out[0] = str(e)
    if env.world_size > 1:
        dist.broadcast_object_list(out, src=0)
    if isinstance(out[0], str):
        raise AgreedError(out[0])  # every rank has the same answer: reported once
    return out[0]


def decide_dirs(cfg: TrainConfig) -> tuple[Path, Any, Any]:
    """(run dir, checkpoint dir, checkpoint to resume from); refuses to write over another run's metrics,
    and refuses folders it cannot write to (a ConfigError, so that ``_agree_on_dirs`` tells every rank). The
    checkpoint dir may be an S3 prefix; with --checkpoint_copy_dir the resume point may be on S3."""
    run_dir = Path(cfg.run_dir or config_mod.default_run_dir())
    ckpt_dir = checkpoint.places.location(cfg.checkpoint_dir) if cfg.checkpoint_dir else run_dir / "checkpoints"
    copy = checkpoint.places.location(cfg.checkpoint_copy_dir) if cfg.checkpoint_copy_dir else None
    if copy is not None and not (isinstance(ckpt_dir, Path) and checkpoint.places.is_s3(copy)):
        raise ConfigError(f"--checkpoint_copy_dir {cfg.checkpoint_copy_dir}: copies go from a file-system "
                          f"--checkpoint_dir to an s3://bucket/prefix (here --checkpoint_dir is {ckpt_dir})")
    resume = checkpoint.places.find_resume(cfg, ckpt_dir)
    # An earlier attempt of this same job (a restart inside the allocation, a requeue) that failed before its first
    # checkpoint starts over in its own run dir; the steps it had done count as restart loss (telemetry/goodput.py).
    earlier = goodput.written_by_this_job(run_dir / "metrics.jsonl")
    if (run_dir / "metrics.jsonl").exists() and resume is None and not earlier:
        raise ConfigError(f"--run_dir {run_dir} already holds metrics.jsonl and there is no checkpoint to resume "
                          f"from in {ckpt_dir}; choose a new --run_dir (nothing was overwritten)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--run_dir {run_dir} cannot be created ({e.strerror or e}); choose a writable "
                          f"--run_dir") from None
    for root in checkpoint.places.roots(cfg, ckpt_dir):  # before anything is computed, not at the first save
        checkpoint.places.probe_writable(cfg, root)
    return run_dir, ckpt_dir, resume


def write_config(cfg: TrainConfig, plan: RunPlan) -> Path:
    """``config.yaml`` (or ``config.resume_step_N.yaml`` for a resumed attempt): asked + resolved."""
    name = "config.yaml" if plan.resume_from is None else \
        f"config.resume_{checkpoint.places.location(plan.resume_from).name}.yaml"
    path = Path(plan.run_dir) / name
    path.write_text(yaml.safe_dump({"asked": config_mod.asked(cfg), "resolved": plan.to_dict()}, sort_keys=False))
    return path
