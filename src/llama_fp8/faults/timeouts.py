"""The collective timeout (--process_group_timeout): the value the groups created beside the default one take,
and one line for a collective that gave up."""

from __future__ import annotations

import datetime
import re

import torch
import torch.distributed as dist


def collective_timeout() -> datetime.timedelta | None:
    """The default group's timeout (--process_group_timeout), for the groups created beside it: torch's
    ``new_group`` would otherwise give them its own default of 30 minutes, and a dead rank would hold the
    others that long in a signal check or a checkpoint's collectives. None when it cannot be read."""
    if not dist.is_initialized():
        return None
    for device in ("cpu", "cuda"):
        try:
            return dist.group.WORLD._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
    return None


def collective_timeout_message(exc: BaseException, timeout_s: float) -> str | None:
    """One line for a collective that gave up after --process_group_timeout - gloo's "Timed out waiting
    Nms for recv operation", NCCL's watchdog "collective operation timeout" - or None for other errors."""
    lines = [ln.strip() for ln in str(exc).splitlines() if re.search(r"[Tt]imed out|operation timeout", ln)]
    if not lines:
        return None
    return (f"a collective did not complete within --process_group_timeout={timeout_s:g} s: another rank is hung "
            f"or dead (its own log says why); the last complete checkpoint is intact, requeue or rerun to resume "
            f"({lines[0][-200:]})")
