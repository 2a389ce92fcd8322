"""A failed save or load described in one line and classified (transient or not), for every rank to report."""

from __future__ import annotations

import shutil
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from llama_fp8 import faults


def _merge(errors: list[str | None]) -> str:
    """Each rank's error (index = rank) as one line: DCP already reports every rank's failure on every rank
    (then those lines are equal and kept once), and errors naming an OS error go first - a full disk shows
    on one rank as ENOSPC and on another as a torch serialization error about a short write."""
    parts: list[str] = []
    for rank, e in enumerate(errors):
        for part in (e.split("; ") if e and e.startswith("rank ") else [f"rank {rank}: {e}"] if e else []):
            if part not in parts:
                parts.append(part)
    return "; ".join(sorted(parts, key=lambda p: "[Errno" not in p))


def _kind(e: BaseException) -> str | None:
    """The transient class of a save's or load's error (DCP's CheckpointException: any rank's), or None."""
    if isinstance(e, CheckpointException):
        return next((k for exc, _ in e.failures.values() if (k := faults.kind_of(exc))), None)
    return faults.kind_of(e)


def _describe(e: BaseException) -> str:
    """One line for an exception of a save or load; DCP's CheckpointException lists each rank's."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {r}: {_describe(exc)}" for r, (exc, _) in sorted(e.failures.items()))
    for cause in (e, e.__cause__, e.__context__):
        if isinstance(cause, OSError):
            where = f" ({cause.filename})" if cause.filename else ""
            return f"{type(cause).__name__}: [Errno {cause.errno}] {cause.strerror}{where}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def _space(folder: Path) -> str:
    """The file system's free space, and whether that means it is full: a full disk does not always show as
    ENOSPC (torch's archive writer reports a short write as an "unexpected pos" error)."""
    try:
        usage = shutil.disk_usage(folder)
    except OSError as e:
        return f"the file system of {folder} cannot be queried ({e.strerror})"
    full = "is FULL" if usage.free < min(usage.total / 100, 64 * 2**20) else "has"
    return f"the file system of {folder} {full}: {usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
