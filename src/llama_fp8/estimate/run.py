"""One measurement: the training program's own build and step, one warm-up step, then one step under the tracker.

    decide (estimate/build.py) -> train.build.build_sharded (meta: build, FP8 convert, TP, AC, fully_shard)
      -> [fake tensors] materialize -> train.build.build_optimizer -> train.loop.train_step (warm-up: creates
         the optimizer states) -> StepTracker around train.loop.train_step (every micro-batch, the gradient
         norm, the optimizer step)

``fake=True`` (the estimate): inside this process as rank 0 of the world on torch's fake process group, the
materialization and the steps on fake tensors with the fake-mode corrections. ``fake=False``: the same program on
real tensors in the process group the caller started (torchrun, gloo): what the equality tests compare against.
The optimizer is built as on a GPU (fused AdamW); batches are random tokens of the configured shape, made inside
the step like the copies a GPU run makes of each batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from llama_fp8 import faults, parallel
from llama_fp8.estimate import build as est_build
from llama_fp8.estimate import corrections, fake, terms
from llama_fp8.estimate.tracker import StepTracker, Where
from llama_fp8.train import build as train_build
from llama_fp8.train import loop

Progress = Callable[[str], None]


@dataclass
class Measurement:
    peak_bytes: int  # the tracker's highest total on this rank
    by_kind: dict[str, int]  # the same peak by kind (the tracker's names)
    where: Where
    micro_batches: int
    collectives: list[dict]  # kind, dim, phase, calls, bytes (per step)
    group_ranks: dict[str, list[int]]  # mesh dimension -> the ranks of this rank's group along it
    decision: est_build.Decision
    num_params: int
    local_param_numel: int  # this rank's shard of the parameters
    seconds: float
    fp8_operand_bytes: int = 0  # terms.fp8_operand_copies of the model (0 without FP8)
    at_optimizer: dict[str, int] | None = None  # by kind as the optimizer step starts (gradients all sharded)
    phase_peaks: list[tuple[int, dict[str, int], Where]] | None = None  # each phase's highest: total, by kind, where


class Batches:
    """Random-token micro-batches of the configured shape, made when fetched (inside the step); tells the tracker
    which micro-batch is running."""

    def __init__(self, cfg):
        self.cfg, self.tracker, self.count = cfg, None, 0

    def __next__(self) -> dict[str, torch.Tensor]:
        self.count += 1
        if self.tracker is not None:
            self.tracker.next_micro_batch()
        shape = (self.cfg.train_batch_size, self.cfg.max_context_width)
        return {"input_ids": torch.randint(0, self.cfg.vocab_size, shape),
                "labels": torch.randint(0, self.cfg.vocab_size, shape)}


def mesh_groups(mesh, dims: parallel.ParallelDims, rank: int) -> tuple[dict[str, str], dict[str, list[int]]]:
    """(process group name -> mesh dimension, mesh dimension -> ranks of ``rank``'s group along it)."""
    import torch.distributed as dist

    names = {dist.group.WORLD.group_name: "world"}
    ranks = {"world": list(range(dims.world_size))}
    for dim in mesh.mesh_dim_names:
        names[mesh.get_group(dim).group_name] = dim
        ranks[dim] = next(g for g in dims.groups(dim) if rank in g)
    return names, ranks


def measure(cfg, env: parallel.DistEnv, fake_run: bool = True, progress: Progress = lambda _: None) -> Measurement:
    """The tracked step of ``cfg`` on rank ``env.rank`` (a fake one when ``fake_run``)."""
    from llama_fp8 import precision

    t0 = time.perf_counter()
    decision = est_build.decide(cfg, env)
    cfg = decision.cfg
    prec = precision.build(decision.precision, decision.impl, cfg)
    progress(f"building {cfg.model} on the meta device and sharding it over {env.world_size} ranks "
             f"({', '.join(f'{n} {s}' for n, s in decision.dims.shape)})")
    torch.manual_seed(cfg.seed)
    mode = fake.tensor_mode() if fake_run else contextlib.nullcontext()
    with corrections.all_corrections() if fake_run else contextlib.nullcontext():
        # Built and sharded on the meta device outside the fake mode, as in training: FSDP2's and DTensor's set-up
        # see the same meta tensors; then allocated (fake or real) and stepped.
        model, size, context, mesh = train_build.build_sharded(cfg, env, decision, decision.impl, prec)
        with mode:
            if fake_run:
                est_build.materialize_fake(model, decision, env.device, prec)
            else:
                train_build.materialize(model, cfg, env, decision.impl)
                prec.prepare(model)
        names, group_ranks = mesh_groups(mesh, decision.dims, env.rank)
        with mode:
            tracker = _steps(cfg, env, decision, model, context, prec, names, progress)
    return Measurement(
        **tracker.summary(), micro_batches=cfg.grad_accum_steps, group_ranks=group_ranks, decision=decision,
        num_params=size.num_params, local_param_numel=train_build.local_numel(model),
        seconds=time.perf_counter() - t0,
        fp8_operand_bytes=terms.fp8_operand_copies(model, cfg.train_batch_size * cfg.max_context_width))


def _steps(cfg, env, decision, model, context, prec, names, progress) -> StepTracker:
    """A warm-up step (it creates the optimizer states), then the tracked one; returns its tracker."""
    optimizer = train_build.build_optimizer(model, cfg, est_build.CUDA, prec)  # fused AdamW, as on a GPU
    state = SimpleNamespace(model=model, env=env, cfg=cfg, context=context, impl=decision.impl, precision=prec,
                            optimizer=optimizer, guard=faults.NanGuard(env.device, "error", 0),
                            observer=SimpleNamespace(fetching=contextlib.nullcontext))  # no launcher to tell
    batches = Batches(cfg)
    progress(f"warm-up step ({cfg.grad_accum_steps} micro-batch(es) of {cfg.train_batch_size} x "
             f"{cfg.max_context_width} tokens)")
    loop.train_step(state, batches, 1)
    progress("tracked step")
    tracker = StepTracker(model, optimizer, names)
    batches.tracker = tracker
    with tracker:
        loop.train_step(state, batches, 2)
    return tracker
