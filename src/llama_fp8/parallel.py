"""Process group, device mesh and FSDP2: the only place that shards anything.

Ranks come from torchrun's environment, or from Slurm's when ``srun`` launches the training processes
directly, or a plain ``python -m llama_fp8 train`` runs as a single process. Nothing assumes a GPU
count per node or a CUDA device.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from llama_fp8.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(*names: str, default: int | None = None) -> int | None:
    for n in names:
        if os.environ.get(n, "") != "":
            return int(os.environ[n].split("(")[0].split(",")[0])
    return default


def _from_environment() -> tuple[int, int, int, int]:
    """(rank, local_rank, world, local_world) from torchrun, else from srun, else a single process."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        return (int(os.environ["RANK"]), _env_int("LOCAL_RANK", default=0), world,
                _env_int("LOCAL_WORLD_SIZE", default=world))
    ntasks = _env_int("SLURM_NTASKS", default=1)
    if ntasks > 1 and "SLURM_PROCID" in os.environ and "SLURM_STEP_ID" in os.environ:
        if "MASTER_ADDR" not in os.environ:
            raise ConfigError("launched by srun with several tasks but MASTER_ADDR is not set: export "
                              "MASTER_ADDR (the first node's address) and MASTER_PORT, or use torchrun")
        os.environ.setdefault("MASTER_PORT", "29500")
        rank = _env_int("SLURM_PROCID")
        local_world = _env_int("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", default=ntasks)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(ntasks))
        return rank, _env_int("SLURM_LOCALID", default=0), ntasks, local_world
    return 0, 0, 1, 1


def init_distributed(cfg: TrainConfig) -> DistEnv:
    """Create the process group (nccl on CUDA, gloo on CPU) and pick this rank's device.

    --process_group_timeout bounds every collective: when a rank dies, the others fail after at most
    that long instead of hanging until the Slurm time limit (torchrun usually stops them sooner)."""
    rank, local_rank, world, local_world = _from_environment()
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but torch sees no CUDA device; use --device cpu or auto")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} but only {torch.cuda.device_count()} CUDA devices visible "
                              f"on this node: launch one process per GPU")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=cfg.process_group_timeout)
    if not dist.is_initialized():
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                    device_id=device if use_cuda else None)
    return DistEnv(rank, local_rank, world, local_world, device)


class AgreedError(ConfigError):
    """A start-up error raised on every rank together (see ``on_every_rank``); rank 0 reports it."""


def on_every_rank(env: DistEnv, check: Callable[[], T]) -> T:
    """Run a start-up step on every rank and agree on its outcome before anyone goes on.

    A check can fail on some ranks only (a path missing on one node, a hub error on one rank). Those
    ranks would exit while the others block in the next collective until --process_group_timeout.
    Here every rank learns of the failure: a ConfigError becomes an ``AgreedError`` carrying the first
    failing rank's message on every rank; any other exception is re-raised (with its traceback) on the
    rank where it happened and reported as an ``AgreedError`` on the others.
    """
    error: BaseException | None = None
    try:
        result = check()
    except Exception as e:  # noqa: BLE001 - every failure must be shared before anything is re-raised
        error = e
    if env.world_size == 1:
        if error is not None:
            raise error
        return result
    mine = None if error is None else str(error) if isinstance(error, ConfigError) else (
        f"{type(error).__name__}: {error}")
    messages: list[str | None] = [None] * env.world_size
    dist.all_gather_object(messages, mine)
    failed = [(rank, msg) for rank, msg in enumerate(messages) if msg is not None]
    if not failed:
        return result
    if error is not None and not isinstance(error, ConfigError):
        raise error
    rank, msg = failed[0]
    where = "" if len(failed) == env.world_size else f" (on rank{'s' if len(failed) > 1 else ''} " \
        f"{', '.join(str(r) for r, _ in failed)} of {env.world_size})"
    raise AgreedError(msg + where)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class ParallelDims:
    """Data-parallel layout: ``dp_replicate`` replicas (HSDP) x ``dp_shard`` ranks each shards over."""

    dp_replicate: int
    dp_shard: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard"):
            v = getattr(self, name)
            if v == 0 or v < -1:
                raise ConfigError(f"--{name}_size {v} is not valid; valid: a positive integer or -1 (fill)")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise ConfigError("--dp_replicate_size and --dp_shard_size cannot both be -1")
        if self.dp_replicate == -1:
            self.dp_replicate = self._fill("dp_replicate", self.dp_shard)
        if self.dp_shard == -1:
            self.dp_shard = self._fill("dp_shard", self.dp_replicate)
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ConfigError(f"--dp_replicate_size {self.dp_replicate} x --dp_shard_size {self.dp_shard} = "
                              f"{self.dp_replicate * self.dp_shard}, but the world size is {self.world_size}")

    def _fill(self, name: str, other: int) -> int:
        if self.world_size % other:
            raise ConfigError(f"world size {self.world_size} is not divisible by {other}, so --{name}_size -1 "
                              f"has no whole value")
        return self.world_size // other

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @classmethod
    def from_config(cls, cfg: TrainConfig, env: DistEnv) -> ParallelDims:
        if cfg.sharding_strategy == "hybrid":
            if (cfg.dp_replicate_size, cfg.dp_shard_size) != (1, -1):
                raise ConfigError("--sharding_strategy hybrid sets the mesh itself; drop --dp_replicate_size/"
                                  "--dp_shard_size or use --sharding_strategy full with them")
            # Replicate across nodes, shard within a node: all-gathers stay on NVLink.
            return cls(env.world_size // env.local_world_size, env.local_world_size, env.world_size)
        return cls(cfg.dp_replicate_size, cfg.dp_shard_size, env.world_size)


def build_mesh(dims: ParallelDims, env: DistEnv):
    from torch.distributed.device_mesh import init_device_mesh

    if dims.hsdp:
        return init_device_mesh(env.device.type, (dims.dp_replicate, dims.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(env.device.type, (dims.dp_shard,), mesh_dim_names=("dp_shard",))


def parallelize(model: nn.Module, layers: nn.ModuleList, mesh, cfg: TrainConfig, impl: str = "hf") -> nn.Module:
    """The fixed order: activation checkpointing -> torch.compile per block -> fully_shard per block -> root.

    With --bf16 1, parameters are all-gathered in BF16 and gradients reduced in FP32.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    for i, layer in enumerate(layers):
        layer = apply_activation_checkpointing(layer, cfg.activation_checkpointing, impl)
        if cfg.compile:
            layer.compile()  # in place: parameter names (and checkpoints) stay the same
        layers[i] = layer
    kwargs = {"mesh": mesh}
    if cfg.bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    te_attrs = None
    if impl == "te":  # fully_shard swaps parameters for DTensors and drops TE's attributes on them
        from llama_fp8 import te_llama

        te_attrs = te_llama.save_param_attrs(model)
    for i, layer in enumerate(layers):
        # The last block is needed first in backward: resharding it after forward would only make
        # backward gather it straight back.
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    if te_attrs is not None:
        te_llama.restore_param_attrs(model, te_attrs)
    return model


def _save_matmuls_policy(ctx, op, *args, **kwargs):
    """Selective AC: keep the outputs of matmuls and attention (expensive to recompute, and the
    bulk of FLOPs), recompute everything else (norms, activations, rotary: cheap, memory-heavy)."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(layer: nn.Module, mode: str, impl: str) -> nn.Module:
    """0: as is; 1: recompute the whole block in backward; selective: per-op policy (HF model only).
    TE blocks use TE's own checkpoint, which recomputes under the same FP8 state."""
    if mode == "0":
        return layer
    if impl == "te":
        if mode == "selective":
            raise ConfigError("--activation_checkpointing selective is for the Hugging Face model; the TE model "
                              "checkpoints whole blocks with TE's checkpoint: use --activation_checkpointing 1")
        from llama_fp8 import te_llama

        return te_llama.te_checkpoint_wrap(layer)
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode == "selective":
        return checkpoint_wrapper(layer, preserve_rng_state=False,
                                  context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls_policy))
    return checkpoint_wrapper(layer, preserve_rng_state=False)


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over all ranks (a collective: call on logging steps only)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t
