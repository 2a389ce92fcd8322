"""The workers' progress as the launcher reads it (each rank's heartbeat file, telemetry/heartbeat.py, and its
process state): which local rank stopped moving, where an attempt failed, and what ended a rank."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llama_fp8.cluster.launch import peers, watchdog


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R running, S sleeping, T stopped, D uninterruptible, Z exited),
    or "?" when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def folder() -> Path:
    """A private folder for the workers' progress files: in memory (/dev/shm) where there is one, so that a
    beat never waits on a busy root disk."""
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="llama-fp8-progress-",
                                 dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))


def stuck_ranks(procs: dict, records: dict[int, dict], now: float, bounds: watchdog.Bounds,
                memory: watchdog.Memory) -> list[str]:
    """Of the running workers (``procs``: global rank -> Popen), those stopped (SIGSTOP, a debugger) or in
    uninterruptible sleep, or without progress for longer than their phase's bound (watchdog.py), with where
    they were: the ranks that stopped moving while another worker failed."""
    stalled = {s.rank: s for s in watchdog.stalls(records, now, bounds, memory)}
    out = []
    for rank, proc in procs.items():
        if proc.poll() is not None:
            continue
        state = proc_state(proc.pid)
        if state in watchdog.STATES or rank in stalled:
            rec = {**records.get(rank, {}), "pid": proc.pid, "state": state, "host": peers.node_name()}
            out.append(watchdog.describe(rank, rec, None, stalled.get(rank)).replace(": ", " stopped moving: ", 1))
    return out


def failure_point(ranks, records: dict[int, dict]) -> tuple:
    """Where an attempt failed on this node: the step the failed ranks (``ranks``: those that failed by
    themselves, not those the launcher killed) were in, or start-up, from their progress files."""
    recs = [records[r] for r in ranks if r in records]
    steps = [r["step"] for r in recs if r.get("phase") in ("step", "data", "eval", "save")]
    return ("step", max(steps)) if steps else ("startup", None)


def error_of(rec: dict) -> tuple[str | None, str | None]:
    """(class, line) of the failure a rank wrote before it exited (telemetry/heartbeat.py ``failed``)."""
    err = rec.get("error") if isinstance(rec, dict) else None
    if not isinstance(err, dict):
        return None, None
    kind, line = err.get("kind"), err.get("line")
    return (kind if isinstance(kind, str) else None), (line[:300] if isinstance(line, str) else None)
