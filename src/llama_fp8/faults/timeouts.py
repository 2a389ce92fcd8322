"""The collective timeouts, the backstop behind the launcher's hang detection: --process_group_timeout for every
process group the training creates (the default group, DeviceMesh's sub-groups, the Transformer Engine model's,
the signal check's), --checkpoint_timeout for the checkpointer's (a save or a load of a large state takes far longer
than a step); and one line for a collective that gave up."""

from __future__ import annotations

import datetime
import re

import torch
import torch.distributed as dist


def _timeout_of(group) -> datetime.timedelta | None:
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
    return None


def collective_timeout() -> datetime.timedelta | None:
    """The default group's timeout (--process_group_timeout), for the groups created beside it: torch's
    ``new_group`` would otherwise give them its own default of 30 minutes, and a dead rank would hold the
    others that long in a signal check. None when it cannot be read."""
    return _timeout_of(dist.group.WORLD) if dist.is_initialized() else None


def apply_timeouts(training_s: float, checkpoint_s: float, checkpoint_groups=()) -> dict[str, float]:
    """Set the timeout of every process group this rank is in: ``checkpoint_s`` for ``checkpoint_groups``,
    ``training_s`` for all others (DeviceMesh and ``new_group`` give a group torch's default, 10 or 30 minutes,
    unless told). Returns group name -> seconds as set (``group_timeouts``)."""
    if not dist.is_initialized():
        return {}
    ckpt = {id(g) for g in checkpoint_groups if g is not None}
    for group in list(dist.distributed_c10d._world.pg_names):
        seconds = checkpoint_s if id(group) in ckpt else training_s
        try:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)
        except (ValueError, RuntimeError, AssertionError):
            continue  # a group this rank is not in
    return group_timeouts()


def group_timeouts() -> dict[str, float]:
    """Group name -> its timeout in seconds, for every process group this rank is in."""
    if not dist.is_initialized():
        return {}
    out = {}
    for group, name in list(dist.distributed_c10d._world.pg_names.items()):
        value = _timeout_of(group)
        if value is not None:
            out[str(name)] = value.total_seconds()
    return out


def collective_timeout_message(exc: BaseException, timeout_s: float) -> str | None:
    """One line for a collective that gave up after --process_group_timeout - gloo's "Timed out waiting
    Nms for recv operation", NCCL's watchdog "collective operation timeout" - or None for other errors."""
    lines = [ln.strip() for ln in str(exc).splitlines() if re.search(r"[Tt]imed out|operation timeout", ln)]
    if not lines:
        return None
    return (f"a collective did not complete within --process_group_timeout={timeout_s:g} s (--checkpoint_timeout "
            f"in a save or a load): another rank is hung or dead (its own log says why); the last complete checkpoint "
            f"is intact, requeue or rerun to resume ({lines[0][-200:]})")
