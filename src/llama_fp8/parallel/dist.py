"""The process group: ranks from torchrun, srun or nothing; agreeing on start-up errors.

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

from llama_fp8 import faults
from llama_fp8.errors import AgreedError, ConfigError
from llama_fp8.faults.transient import AgreedTransient

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


def device_type(asked: str) -> str:
    """``--device`` as it will run: ``cuda`` when asked for, or for ``auto`` when torch sees a GPU; else ``cpu``.
    The one place that decides it (training and preflight ask here)."""
    return "cuda" if asked == "cuda" or (asked == "auto" and torch.cuda.is_available()) else "cpu"


def init_distributed(cfg) -> DistEnv:
    """Create the process group (nccl on CUDA, gloo on CPU) and pick this rank's device.

    --process_group_timeout bounds every collective: when a rank dies, the others fail after at most
    that long instead of hanging until the Slurm time limit (torchrun usually stops them sooner)."""
    rank, local_rank, world, local_world = _from_environment()
    use_cuda = device_type(cfg.device) == "cuda"
    if use_cuda:
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but torch sees no CUDA device; use --device cpu or auto")
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} but only {torch.cuda.device_count()} CUDA devices visible "
                              f"on this node: launch one process per GPU")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(seconds=cfg.process_group_timeout)
    if not dist.is_initialized():
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                    device_id=dev if use_cuda else None)
    return DistEnv(rank, local_rank, world, local_world, dev)


def on_every_rank(env: DistEnv, check: Callable[[], T]) -> T:
    """Run a start-up step on every rank and agree on its outcome before anyone goes on.

    A check can fail on some ranks only (a path missing on one node, a hub error on one rank). Those
    ranks would exit while the others block in the next collective until --process_group_timeout.
    Here every rank learns of the failure: a ConfigError becomes an ``AgreedError`` carrying the first
    failing rank's message on every rank (exit 2: a rerun would fail the same way); any other exception is
    re-raised (with its traceback) on the rank where it happened, and the others raise an ``AgreedTransient``
    naming that rank: a peer's failure, which a restart may well not repeat (exit 75), not a bad config.
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
    mine = None if error is None else ("config", str(error)) if isinstance(error, ConfigError) else (
        "error", faults.describe(error))
    messages: list[tuple[str, str] | None] = [None] * env.world_size
    dist.all_gather_object(messages, mine)
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return result
    if error is not None and not isinstance(error, ConfigError):
        raise error
    rank, (kind, msg) = failed[0]
    where = "" if len(failed) == env.world_size else f" (on rank{'s' if len(failed) > 1 else ''} " \
        f"{', '.join(str(r) for r, _ in failed)} of {env.world_size})"
    if kind == "config":
        raise AgreedError(msg + where)
    raise AgreedTransient("peer", f"rank {rank} failed at start-up ({msg}){where}")


def destroy_distributed(barrier: bool = False) -> None:
    if dist.is_initialized():
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of a tensor over all ranks (a collective: call on logging steps only)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t
