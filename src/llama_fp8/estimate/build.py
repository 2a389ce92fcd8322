"""What an estimate builds, decided by the function a training run's plan asks (``plan.decide_setup``, without
the data, sink and device-option checks, which do not change the memory), for the GPU job it stands for:

- the layout: ``ParallelDims.from_config`` for nodes x GPUs per node, ``check_shapes``;
- the job's implementation: ``--model_impl``, where ``auto`` is what it picks on a GPU node with every
  implementation installed (the TE model where Transformer Engine imports, as in the default image), whether or
  not it imports on this machine; a login node without it estimates the TE job and says so. Every refusal the
  GPU node would make of these flags (the implementation's, and its FP8 backend's of the flags alone) is made
  here too, before anything else: a flag training refuses is refused, wherever the estimate runs;
- what runs here: the job's implementation, or where its layers cannot run in this CPU process (the TE model:
  CUDA kernels) a stand-in, the implementation ``auto`` picks on a CPU machine (the Hugging Face Llama), with the
  same shapes and its own FP8 backend; the estimate says so;
- the precision: ``precision.resolve`` on this (CPU) device, where torchao's FP8 is emulated: the same layers,
  casts and saved tensors, and on CPU its tensor-parallel collectives stay BF16 (gloo has no float8 type),
  as they would here; the estimate states it.

Options the fake run cannot show are refused or stated: ``--cpu_offload 1`` (host memory), torchao's
low-precision optimizers (their kernels read data), ``--compile 1`` (estimated eager: the tracker cannot see into
compiled graphs).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from llama_fp8 import models, parallel, plan, precision
from llama_fp8.errors import ConfigError

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@dataclass(frozen=True)
class Decision:
    """The estimate's plan: what ``train.build`` reads of a RunPlan (``dims``, ``precision``), and what differs from
    the job it stands for (``notes``)."""

    cfg: object  # the TrainConfig the estimate builds (the stand-in's, if any; --compile 0)
    impl: models.ModelImpl  # what is built and run here
    dims: parallel.ParallelDims
    precision: precision.PrecisionChoice
    stand_in: str | None = None  # why the estimated implementation is not the job's
    notes: tuple[str, ...] = ()
    target: models.ModelImpl | None = None  # the job's implementation (``impl`` unless a stand-in runs)

    @property
    def job_impl(self) -> models.ModelImpl:
        return self.target or self.impl


def env_for(world_size: int, gpus_per_node: int, rank: int = 0) -> parallel.DistEnv:
    """Rank ``rank`` of the job, on the CPU device the fake tensors live on."""
    return parallel.DistEnv(rank, rank % gpus_per_node, world_size, min(gpus_per_node, world_size), CPU)


@contextlib.contextmanager
def _as_installed(impl: models.ModelImpl) -> Iterator[None]:
    """``impl`` as on a node where its library imports: whether it is installed here is not the question."""
    impl.unavailable = lambda device: None  # an instance attribute over the method, removed below
    try:
        yield
    finally:
        del impl.unavailable


def job_impl(cfg) -> tuple[models.ModelImpl, str | None]:
    """(the implementation the job runs on its GPU nodes, a note when that is ``auto``'s choice on a GPU node
    with every implementation installed, which differs from its choice on a GPU node like this machine)."""
    if cfg.model_impl != "auto":
        return models.get(cfg.model_impl), None
    here = models.resolve("auto", CUDA)
    for impl in models.implementations():
        with _as_installed(impl):
            if impl.auto_eligible(CUDA):
                break
    if impl is here:
        return impl, None
    return impl, (f"--model_impl auto picks {impl.name} {impl.auto_when} (the job's image may have it; this machine "
                  f"does not), else {here.name}: estimated for {impl.name}; give --model_impl {here.name} for nodes "
                  f"without it")


def check_as_on_a_gpu_node(impl: models.ModelImpl, cfg, assumed: str | None = None) -> None:
    """The refusals of these flags a CUDA node with ``impl`` installed makes before building (the implementation's
    own, its FP8 backend's of the flags alone), as training makes them; ``assumed``: why ``impl`` is the job's
    (added to a refusal: another ``--model_impl`` may take these flags)."""
    with _as_installed(impl):
        try:
            impl.check(cfg, CUDA)
            precision.check_flags(cfg, impl, models.implementations())
        except ImportError:  # a check that needs the library itself: left to the GPU node
            pass
        except ConfigError as e:
            if assumed is None:
                raise
            raise ConfigError(f"{e} ({assumed})") from None


def choose_impl(cfg, target: models.ModelImpl, here: torch.device = CPU) -> tuple[models.ModelImpl, str | None]:
    """(the implementation the estimate runs on device ``here``, why it is not ``target``, the job's, or None)."""
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


def stand_in_recipe(cfg, impl: models.ModelImpl) -> tuple[str, str | None]:
    """The recipe a stand-in runs for the job's: the same format where the stand-in's FP8 backend has it and emulates
    it on CPU (an MXFP8 job through torchao's emulated MXFP8: its quantized copies and float32 temporaries, which a
    GPU kernel does not make, so an upper bound of the transients), else its default, said in a note."""
    if not cfg.fp8 or cfg.fp8_recipe == "auto":
        return "auto", None
    from llama_fp8.precision import recipes

    backend = impl.fp8_backends()[0].name if impl.fp8_backends() else None
    rows = {r.name: r for r in recipes.rows_of(backend)} if backend else {}
    if cfg.fp8_recipe in rows and rows[cfg.fp8_recipe].emulated_on_cpu:
        return cfg.fp8_recipe, (f"--fp8_recipe {cfg.fp8_recipe} estimated through {backend}'s emulated "
                                f"{cfg.fp8_recipe} (its CPU path: an upper bound of the quantization transients)")
    return "auto", (f"--fp8_recipe {cfg.fp8_recipe} has no CPU path on the stand-in: its layers estimated as "
                    f"{recipes.default_for(backend).name} ({backend}) ones" if backend else None)


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
    target, assumed = job_impl(cfg)
    check_as_on_a_gpu_node(target, cfg, assumed)  # the job's flags as they are (--compile included)
    notes = []
    if cfg.compile:
        cfg = dataclasses.replace(cfg, compile=False)
        notes.append("--compile 1 estimated eager (the tracker cannot see inside compiled graphs; compiled blocks "
                     "usually need less activation memory)")
    impl, why = choose_impl(cfg, target, env.device)
    stand_in = None
    if why is not None:
        stand_in = f"{assumed}. {why}" if assumed else why
        recipe, note = stand_in_recipe(cfg, impl)
        cfg = dataclasses.replace(cfg, fp8_backend="auto", fp8_recipe=recipe)
        notes += [note] if note else []
    cfg = dataclasses.replace(cfg, model_impl=impl.name)
    try:
        impl, choice, dims = plan.decide_setup(cfg, env, impl=impl, memory_only=True)
    except ConfigError as e:
        if stand_in is None:
            raise
        raise ConfigError(f"cannot be estimated through the stand-in --model_impl {impl.name} for --model_impl "
                          f"{target.name}: {e}") from None
    if choice.backend != "none" and choice.format not in ("", "fp8") and choice.emulated and stand_in is None:
        notes.append(f"{choice.name} estimated through its emulated CPU path (its quantized copies and float32 "
                     f"temporaries, which a GPU kernel does not make: an upper bound of the transients)")
    if choice.backend != "none" and dims.tp > 1:
        notes.append("tensor-parallel collectives counted in BF16: FP8 ones (torchao's FP8 styles need NCCL)")
    return Decision(cfg, impl, dims, choice, stand_in, tuple(notes), target)


def materialize_fake(model: torch.nn.Module, decision: Decision, device: torch.device, prec) -> None:
    """Inside the fake tensor mode: allocate this rank's shards (``to_empty``) and recompute the buffers, as
    ``train.build.build_model`` does. The weights' values are not drawn: nothing reads them, and the init's
    bookkeeping (the shard's offsets) asks the mesh for values fake tensors do not have."""
    decision.impl.materialize(model, device, decision.cfg)
    decision.impl.reset_buffers(model, device)
    prec.prepare(model)
