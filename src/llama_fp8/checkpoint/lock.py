"""One job per checkpoint folder: an exclusive lock file, ``--checkpoint_dir/LOCK``.

Two jobs saving into one folder would delete each other's checkpoints (``--keep_last_k``, the removal of
interrupted saves) or load one while the other deletes it. Rank 0 creates ``LOCK`` with ``O_CREAT|O_EXCL``
(atomic, also on NFS v3+ and Lustre) before anything in the folder is renamed or deleted, writes its holder
into it (Slurm job id, host, pid, start time) and removes it when the process exits. A second job finds it
and stops at start-up (exit 2) with one message naming the holder.

A lock is stale, and is taken over with a warning, when

- its holder is this very job requeued (the same ``SLURM_JOB_ID``: Slurm requeues a job only after all its
  processes ended), or
- its holder ran on this host and its pid is no longer alive (a process killed by SIGKILL or OOM cannot
  remove its lock), or is this process (an earlier run in the same Python process).

A lock of another host (or another job) whose holder died cannot be judged from here: the message says to
remove the file by hand once that job is known to be gone (``scontrol show job ID`` / ``squeue``). So can a
lock file that cannot be parsed (cut short by a crash while it was written).
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
from pathlib import Path

from llama_fp8.checkpoint import safe_io
from llama_fp8.errors import ConfigError

log = logging.getLogger("llama_fp8.checkpoint")
LOCK = "LOCK"
_held: set[Path] = set()


def me() -> dict:
    return {"job_id": os.environ.get("SLURM_JOB_ID") or None, "host": socket.gethostname(), "pid": os.getpid(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def acquire(ckpt_dir: Path) -> None:
    """Take the lock of ``ckpt_dir`` for this process (rank 0); ConfigError naming the holder if another
    job holds it."""
    path, mine = Path(ckpt_dir) / LOCK, me()
    for _ in range(3):  # a stale lock removed, then created again: at most a few rounds
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except FileExistsError:
            holder = _holder(path)
            why = _stale(holder, mine)
            if why is None:
                raise ConfigError(_busy(path, holder)) from None
            log.warning("taking over the lock %s: %s", path, why)
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(mine) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if not _held:
            atexit.register(release_all)
        _held.add(path)
        return
    raise ConfigError(f"{path}: another job keeps taking this checkpoint folder's lock; run one job per "
                      f"--checkpoint_dir")


def release(ckpt_dir: Path) -> None:
    """Remove the lock if this process holds it (never another job's)."""
    path = Path(ckpt_dir) / LOCK
    holder = _holder(path)
    if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)
    _held.discard(path)


def release_all() -> None:
    for path in list(_held):
        release(path.parent)


def _holder(path: Path) -> dict | None:
    try:
        data = json.loads(safe_io.read_capped(path, 64 << 10))
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _stale(holder: dict | None, mine: dict) -> str | None:
    """Why ``holder``'s lock may be taken over by ``mine``; None if it may not."""
    if holder is None:
        return None
    if mine["job_id"] and holder.get("job_id") == mine["job_id"]:
        return f"held by this same job {mine['job_id']} before a requeue or restart"
    if holder.get("host") != mine["host"] or not isinstance(holder.get("pid"), int):
        return None
    if holder["pid"] == mine["pid"]:
        return "held by this process (an earlier run in it)"
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return f"its holder (pid {holder['pid']} on this host, since {holder.get('since')}) is no longer running"
    except PermissionError:  # alive, another user's
        return None
    return None


def _busy(path: Path, holder: dict | None) -> str:
    if holder is None:
        return (f"--checkpoint_dir {path.parent} is locked by {path}, which cannot be read (cut short?). If no "
                f"job uses this folder, remove {path} and rerun (nothing was changed)")
    job = f"Slurm job {holder.get('job_id')}" if holder.get("job_id") else "a job outside Slurm"
    return (f"--checkpoint_dir {path.parent} is in use by {job} on host {holder.get('host')} (pid "
            f"{holder.get('pid')}, since {holder.get('since')}): two jobs in one checkpoint folder would delete "
            f"each other's checkpoints. Use another --checkpoint_dir, or wait for that job to end; if it is gone "
            f"(its node died), remove {path} and rerun (nothing was changed)")
