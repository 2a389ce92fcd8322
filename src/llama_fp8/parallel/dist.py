"""The process group: ranks from torchrun, srun or nothing; agreeing on start-up errors.

Ranks come from torchrun's environment, or from Slurm's when ``srun`` launches the training processes
directly, or a plain ``python -m llama_fp8 train`` runs as a single process. Nothing assumes a GPU
count per node or a CUDA device.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import warnings
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
    """``--device`` as it will run on this process: ``cuda`` when asked for, or for ``auto`` when torch sees a GPU;
    else ``cpu``. (With several ranks, ``init_distributed`` makes every rank agree: ``agree_device``.)"""
    return "cuda" if asked == "cuda" or (asked == "auto" and torch.cuda.is_available()) else "cpu"


def cuda_state(local_rank: int) -> tuple[bool, str]:
    """(whether this rank can run on its GPU, why not / what it sees), without raising."""
    if not torch.backends.cuda.is_built():
        return False, "this torch is built without CUDA"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ok = torch.cuda.is_available()
    if not ok:
        said = [str(w.message).splitlines()[0] for w in seen if "CUDA" in str(w.message)]
        return False, said[-1][:300] if said else "torch sees no CUDA device (no driver, or no GPU visible)"
    count = torch.cuda.device_count()
    if local_rank >= count:
        return False, f"only {count} CUDA device(s) visible here, local rank {local_rank} needs {local_rank + 1}"
    return True, f"{count} CUDA device(s)"


def agree_device(asked: str, rank: int, world: int, local_rank: int, store) -> str:
    """``cuda`` or ``cpu`` for every rank alike, decided once for the job through the process group's store: with
    ``--device auto`` a node whose CUDA does not start would run gloo while the others run NCCL, and the start-up
    would hang until the timeout. Every rank CUDA: ``cuda``; none: ``cpu`` (auto) or a ConfigError (cuda: the
    setting); some: a TransientError on every rank naming the nodes whose CUDA did not start and why (class
    ``cuda_startup`` there, ``peer`` elsewhere), so that the launcher charges those nodes and leaves them behind."""
    ok, why = cuda_state(local_rank) if asked in ("auto", "cuda") else (False, "--device cpu")
    if asked == "cpu" or world == 1 or store is None:
        if asked == "cuda" and not ok:
            raise ConfigError(f"--device cuda but {why}; use --device cpu or auto")
        return "cuda" if ok and asked != "cpu" else "cpu"
    agree = dist.PrefixStore("llama-fp8-device", store)
    agree.set(str(rank), json.dumps({"ok": ok, "why": why, "host": socket.gethostname().split(".")[0],
                                     "node": os.environ.get("SLURMD_NODENAME")}))
    agree.wait([str(r) for r in range(world)])
    seen = {r: json.loads(agree.get(str(r))) for r in range(world)}
    good = [r for r, s in seen.items() if s["ok"]]
    if len(good) == world:
        return "cuda"
    if not good:
        if asked == "cuda":
            raise ConfigError(f"--device cuda but {seen[0]['why']} (on every rank); use --device cpu or auto")
        return "cpu"
    bad: dict[str, list[int]] = {}
    for r, s in seen.items():
        if not s["ok"]:
            bad.setdefault(f"{s['node'] or s['host']} ({s['why']})", []).append(r)
    where = "; ".join(f"{node}: rank(s) {', '.join(map(str, ranks))}" for node, ranks in bad.items())
    line = (f"--device {asked}: CUDA did not start on {where}, while {len(good)} of {world} ranks have it: every rank "
            f"must run on CUDA or none (a node without it would run gloo beside NCCL and hang the start-up)")
    raise faults.TransientError("peer" if ok else "cuda_startup", line)


def init_distributed(cfg) -> DistEnv:
    """Create the process group (nccl on CUDA, gloo on CPU: the same on every rank, ``agree_device``) and pick this
    rank's device.

    --process_group_timeout bounds every collective: when a rank dies, the others fail after at most
    that long instead of hanging until the Slurm time limit (the launcher's hang detection usually stops them
    sooner)."""
    rank, local_rank, world, local_world = _from_environment()
    timeout = datetime.timedelta(seconds=cfg.process_group_timeout)
    store = None
    if not dist.is_initialized() and (world > 1 or "MASTER_ADDR" in os.environ):
        from torch.distributed.rendezvous import rendezvous

        store, _, _ = next(rendezvous("env://", rank, world, timeout=timeout))
        store.set_timeout(timeout)
    use_cuda = agree_device(cfg.device, rank, world, local_rank, store) == "cuda"
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        if store is None:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:  # the store the device was agreed on, under the prefix torch gives its own
            dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world,
                                    timeout=timeout, device_id=dev if use_cuda else None)
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
