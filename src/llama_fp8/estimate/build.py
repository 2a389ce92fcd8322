"""What an estimate builds, decided by the same functions a training run's plan asks (``plan._decide_setup``
without the data, folder and resume checks, which do not change memory), for the GPU job it stands for:

- the layout: ``ParallelDims.from_config`` for nodes x GPUs per node, ``check_shapes``;
- the implementation ``--model_impl`` resolves to on a CUDA node (``auto``: the TE model where Transformer Engine
  imports). An implementation whose layers cannot run in this CPU process (the TE model: CUDA kernels) is
  estimated through a stand-in, the implementation ``auto`` picks on a CPU machine (the Hugging Face Llama), with
  the same shapes; the estimate says so. One that the GPU node itself would refuse is refused here too.
- the precision: ``precision.resolve`` on this (CPU) device, where torchao's FP8 is emulated: the same layers,
  casts and saved tensors, and on CPU its tensor-parallel collectives stay BF16 (gloo has no float8 type),
  as they would here; the estimate states it.

Options the fake run cannot show are refused or stated: ``--cpu_offload 1`` (host memory), torchao's
low-precision optimizers (their kernels read data), ``--compile 1`` (estimated eager: the tracker cannot see into
compiled graphs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llama_fp8 import models, parallel, precision
from llama_fp8.errors import ConfigError

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@dataclass(frozen=True)
class Decision:
    """The estimate's plan: what ``train.build`` reads of a RunPlan (``dims``, ``precision``), and what differs from
    the job it stands for (``notes``)."""

    cfg: object  # the TrainConfig the estimate builds (the stand-in's, if any; --compile 0)
    impl: models.ModelImpl
    dims: parallel.ParallelDims
    precision: precision.PrecisionChoice
    stand_in: str | None = None  # why the estimated implementation is not the job's
    notes: tuple[str, ...] = ()


def env_for(world_size: int, gpus_per_node: int, rank: int = 0) -> parallel.DistEnv:
    """Rank ``rank`` of the job, on the CPU device the fake tensors live on."""
    return parallel.DistEnv(rank, rank % gpus_per_node, world_size, min(gpus_per_node, world_size), CPU)


def check_as_on_a_gpu_node(impl: models.ModelImpl, cfg) -> None:
    """The implementation's own refusals of these flags, as a CUDA node with the implementation installed makes
    them: whether it is installed here is not the question (an estimate from a login node without Transformer
    Engine still refuses what the TE model refuses)."""
    impl.unavailable = lambda device: None  # an instance attribute over the method, removed below
    try:
        impl.check(cfg, CUDA)
    except ImportError:  # a check that needs the library itself: left to the GPU node
        pass
    finally:
        del impl.unavailable


def choose_impl(cfg, here: torch.device = CPU) -> tuple[models.ModelImpl, str | None]:
    """(the implementation the estimate runs on device ``here``, why it stands in for the job's, or None)."""
    target = models.resolve(cfg.model_impl, CUDA)
    check_as_on_a_gpu_node(target, cfg)
    try:
        target.check(cfg, here)
        return target, None
    except ConfigError as e:
        why = str(e)
    stand_in = models.resolve("auto", here)
    if stand_in is target:
        raise ConfigError(f"cannot be estimated: {why}")
    return stand_in, (f"--model_impl {target.name} ({target.description}) cannot run in this CPU process ({why}); "
                      f"estimated through --model_impl {stand_in.name} ({stand_in.description}) with the same "
                      f"shapes, its activation checkpointing and FP8 backend: its fused layers save other "
                      f"activations, so treat the numbers as an approximation")


def decide(cfg, env: parallel.DistEnv) -> Decision:
    """Every decision for a run on ``env.device`` (the CPU for an estimate; a GPU for the GPU test's real run), or
    a ConfigError naming the flag (as ``train`` would, or why it cannot be estimated)."""
    if cfg.cpu_offload:
        raise ConfigError("--cpu_offload 1 cannot be estimated: it moves the sharded parameters, gradients and "
                          "optimizer states to host memory, which this estimate does not model; estimate without it "
                          "(an upper bound of the GPU memory)")
    if cfg.optimizer != "adamw":
        raise ConfigError(f"--optimizer {cfg.optimizer} cannot be estimated: torchao's low-precision optimizer kernels "
                          "read tensor data, which fake tensors do not have; estimate with --optimizer adamw (an upper "
                          "bound: FP32 states, 8 bytes per parameter where these keep about 2)")
    notes = []
    if cfg.compile:
        cfg = dataclasses.replace(cfg, compile=False)
        notes.append("--compile 1 estimated eager (the tracker cannot see inside compiled graphs; compiled blocks "
                     "usually need less activation memory)")
    impl, stand_in = choose_impl(cfg, env.device)
    if stand_in:
        cfg = dataclasses.replace(cfg, model_impl=impl.name, fp8_backend="auto", fp8_recipe="auto")
        impl.check(cfg, env.device)
    dims = parallel.ParallelDims.from_config(cfg, env)
    parallel.check_shapes(cfg, dims)
    choice = precision.resolve(cfg, impl, env.device, env.world_size, models.implementations())
    if choice.backend != "none" and dims.tp > 1:
        notes.append("tensor-parallel collectives counted in BF16: FP8 ones (torchao's FP8 styles) need NCCL")
    return Decision(cfg, impl, dims, choice, stand_in, tuple(notes))


def materialize_fake(model: torch.nn.Module, decision: Decision, device: torch.device, prec) -> None:
    """Inside the fake tensor mode: allocate this rank's shards (``to_empty``) and recompute the buffers, as
    ``train.build.build_model`` does. The weights' values are not drawn: nothing reads them, and the init's
    bookkeeping (the shard's offsets) asks the mesh for values fake tensors do not have."""
    decision.impl.materialize(model, device, decision.cfg)
    decision.impl.reset_buffers(model, device)
    prec.prepare(model)
