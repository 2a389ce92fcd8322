"""Everything a running training job holds, built once in the fixed order (``start``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llama_fp8 import checkpoint, faults, models, parallel, precision
from llama_fp8 import config as config_mod
from llama_fp8.config import ConfigError, TrainConfig
from llama_fp8.errors import AgreedError
from llama_fp8.models.common import ModelSize
from llama_fp8.plan import RunPlan, make_plan
from llama_fp8.telemetry import (
    goodput,
    gpu_health,
    heartbeat,
    metrics,
    outputs,
    peaks,
    profiling,
    sinks,
    stragglers,
    time_limit,
)
from llama_fp8.train import build
from llama_fp8.train.observer import RunObserver

log = logging.getLogger("llama_fp8.train")


@dataclass
class TrainState:
    cfg: TrainConfig
    plan: RunPlan
    env: parallel.DistEnv
    impl: models.ModelImpl
    precision: precision.Runtime  # precision.build()
    model: nn.Module
    size: ModelSize
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: Any
    val_loader: Any
    checkpointer: checkpoint.Checkpointer
    writer: sinks.MetricsWriter  # every sink this rank writes to (telemetry/outputs.py)
    watch: faults.SignalWatch
    guard: faults.NanGuard
    start_step: int
    context: parallel.StepContext  # what each step runs inside (tensor/context parallelism)
    observer: RunObserver  # heartbeat, goodput, per-rank timing, profiler, the logging window (observer.py)

    def close(self) -> None:
        with self.observer.waiting_for_save():  # an async save still in flight
            self.checkpointer.wait()
            self.checkpointer.join_copy()  # the last copy to S3 (rank 0, --checkpoint_copy_dir)
        self.observer.close()
        self.watch.close()
        self.writer.close(self.observer.clock.ended)


def start(cfg: TrainConfig, env: parallel.DistEnv, beat: heartbeat.Heartbeat | None = None) -> TrainState:
    """Plan, build the model, optimizer and loaders, resume if there is a checkpoint, open the sinks. ``beat``: this
    rank's progress file for the launcher, started by the caller before anything else (one is made here if not)."""
    from llama_fp8 import data

    beat = beat or heartbeat.Heartbeat(env.rank)
    marks = goodput.startup
    plan, impl, prec, model, size, context = plan_and_build_model(cfg, env)
    optimizer = build.build_optimizer(model, cfg, env.device, prec)
    scheduler = build.build_scheduler(optimizer, cfg)
    train_loader, val_loader = parallel.on_every_rank(env, lambda: build.build_loaders(cfg, env, plan.dims))
    marks.mark("optimizer_and_data")
    places = checkpoint.places
    ckpt = checkpoint.Checkpointer(places.location(plan.checkpoint_dir), cfg.keep_last_k, cfg.async_checkpoint,
                                   env.rank, env.world_size, cfg.checkpoint_timeout,
                                   s3=places.target(cfg, plan.checkpoint_dir),
                                   copy=places.copier(cfg, env.rank))
    start_step = 0
    if plan.resume_from:
        try:
            start_step = ckpt.load(places.location(plan.resume_from), model, optimizer, scheduler, train_loader,
                                   cfg.train_batch_size, source=places.target(cfg, plan.resume_from))
        except data.DataStateError as e:
            raise ConfigError(f"cannot resume from {plan.resume_from}: {e}") from None
        except AgreedError as e:  # a checkpoint loaded without the start-up check: the next attempt checks it
            if plan.resume_checked:
                raise
            raise faults.AgreedTransient("io", f"{e}; it was loaded without the start-up check (this job saved it): "
                                               f"the next attempt checks it in full and falls back to an older one") from None
        marks.mark("checkpoint_load")
    # steps an earlier attempt logged past the checkpoint resumed from are redone: restart loss
    redo_until = goodput.last_logged_step(Path(plan.run_dir) / "metrics.jsonl") if env.is_main else 0
    clock = goodput.Goodput(start_step, goodput.first_log_step(start_step, cfg.logging_freq, cfg.max_steps),
                            redo_until, cfg.async_checkpoint)
    meter, writer = start_metrics(cfg, plan, env, size, start_step)
    beat.latest_checkpoint = lambda: ckpt.last_complete
    lead = time_limit.LeadCheck(time_limit.lead_from_env(), time_limit.limit_from_env(),
                                lambda step: places.recorded_save_s(cfg, places.location(plan.checkpoint_dir) /
                                                                    f"step_{step}"),
                                log) if env.is_main else None
    if plan.resume_from:  # the launcher's hang bound for the first save, and the lead: what this checkpoint's took
        saved_s = places.recorded_save_s(cfg, places.location(plan.resume_from))
        beat.expect("save", saved_s)
        if lead is not None:
            lead.at_start(saved_s, f"the save of {places.location(plan.resume_from).name}, as its manifest recorded")
    beat.beat(start_step, "startup")  # built and resumed: a failure from here on is not a start-up failure
    observer = RunObserver(
        heartbeat=beat, clock=clock, meter=meter, writer=writer, precision=prec,
        ranks=stragglers.RankMonitor(env.device, env.local_rank, cfg.straggler_threshold_pct,
                                     gpu_health.GpuHealth(env.device.type, env.device.index)),
        profiler=profiling.Profiler(cfg, Path(plan.run_dir), env.rank, env.device),
        precision_name=plan.precision.name, world_size=env.world_size, is_main=env.is_main, start_step=start_step,
        lead=lead, readers_per_batch=env.world_size // plan.dims.dp_size)
    watch = faults.SignalWatch(env.world_size)
    marks.mark("sinks")
    # Every group exists now (the mesh's, the model's, the signal check's, the checkpointer's): each gets its timeout.
    faults.apply_timeouts(cfg.process_group_timeout, cfg.checkpoint_timeout, [ckpt.group])
    return TrainState(cfg, plan, env, impl, prec, model, size, optimizer, scheduler, train_loader, val_loader, ckpt,
                      writer, watch, faults.NanGuard(env.device, cfg.nan_policy, cfg.max_nan_skips), start_step,
                      context, observer)


def plan_and_build_model(cfg: TrainConfig, env: parallel.DistEnv):
    """(plan, implementation, precision runtime, model, size, step context): the run plan, then the model in the
    fixed order."""
    torch.manual_seed(cfg.seed)
    plan = make_plan(cfg, env)
    goodput.startup.mark("plan_and_checkpoint_check")
    impl = models.get(plan.model_impl)
    prec = precision.build(plan.precision, impl, cfg, Path(plan.run_dir))
    model, size, context = build.build_model(cfg, env, plan, impl, prec)
    goodput.startup.mark("model")
    return plan, impl, prec, model, size, context


def start_metrics(cfg: TrainConfig, plan: RunPlan, env: parallel.DistEnv, size: ModelSize, start_step: int):
    from llama_fp8.telemetry import (
        environment,  # meta record: nodes, GPU/driver, versions, NCCL network
        repro,
    )
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"
    peak_bf16, peak_fp8, peak_source = peaks.resolve(device_name if env.device.type == "cuda" else None,
                                                     cfg.peak_tflops)
    peak_fp4 = peaks.fp4_peak(device_name if env.device.type == "cuda" else None, cfg.peak_tflops)
    meter = metrics.StepMeter(env.device, env.world_size, plan.global_batch, cfg.max_context_width,
                              size.flops_per_token, peak_bf16, peak_fp8, cfg.fp8, peak_fp4, plan.precision.format,
                              emulated=plan.precision.emulated)
    run_dir = Path(plan.run_dir)
    # attempts before this one (a resumed or restarted run's metrics.jsonl has their meta records): read before the
    # writer appends this attempt's
    restarts = goodput.earlier_attempts(run_dir / "metrics.jsonl") if env.is_main else 0
    origin = outputs.Origin.here(run_dir, env.rank, env.local_rank, env.is_main, plan.precision.name)
    writer = outputs.open_writer(cfg, origin, {"asked": config_mod.asked(cfg), "resolved": plan.to_dict()})
    writer.write({"type": "meta", "precision": plan.precision.name, "model": cfg.model, "model_impl": plan.model_impl,
                  "world_size": env.world_size, "device": env.device.type, "device_name": device_name,
                  "peak_tflops_bf16": peak_bf16, "peak_tflops_fp8": peak_fp8, "peak_tflops_fp4": peak_fp4,
                  "peak_source": peak_source, "precision_format": plan.precision.format,
                  "flops_convention": metrics.FLOPS_CONVENTION, "seq_len": cfg.max_context_width,
                  "global_batch_size": plan.global_batch,
                  "flops_per_token": size.flops_per_token, "num_params": size.num_params,
                  "fp8_emulated": plan.precision.emulated, "start_step": start_step, "restarts": restarts,
                  "environment": environment.describe(env.device.type) if env.is_main else {},
                  "repro": repro.describe() if env.is_main else {}})
    return meter, writer
