"""The workers' progress as the launcher reads it (each rank's heartbeat file, telemetry/heartbeat.py, and its
process state): which rank stopped moving, and where an attempt failed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llama_fp8.telemetry import heartbeat

STILL_S, STEP_FACTOR = 10.0, 3.0
"""A live rank in a step, without progress for max(STILL_S, STEP_FACTOR x its previous step's duration) when
another rank fails, is named as the one that stopped moving (a rank that is merely slower notices a crashed peer
within a second on gloo; a hung one never moves again). In evaluation, a save or start-up, where no duration is
known, only its process state (stopped, uninterruptible) names it."""
STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "D": "in uninterruptible sleep"}
PLACES = {"step": "in step {}", "eval": "evaluating step {}", "save": "saving step {}",
          "startup": "before its first step", "finished": "after training finished"}


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


def stuck_ranks(procs: dict, records: dict[int, dict], now: float) -> list[str]:
    """Of the running workers (``procs``: global rank -> Popen), those stopped (SIGSTOP, a debugger,
    uninterruptible sleep) or in a step without progress for far longer than their steps take (``STILL_S``),
    with where they were: the ranks that stopped moving while another worker failed."""
    out = []
    for rank, proc in procs.items():
        if proc.poll() is not None:
            continue
        rec = records.get(rank, {})
        beat, step_s = heartbeat.number(rec, "time"), heartbeat.number(rec, "step_s")
        still = now - beat if beat is not None else None
        state = proc_state(proc.pid)
        how = STATES.get(state)
        limit = max(STILL_S, STEP_FACTOR * step_s) if rec.get("phase") == "step" and step_s is not None else None
        if how is None and (still is None or limit is None or still < limit):
            continue
        where = PLACES.get(rec.get("phase"), PLACES["startup"]).format(rec.get("step")) + (
            f", no progress for {still:.0f} s" if still is not None else "")
        out.append(f"rank {rank} (pid {proc.pid}) stopped moving: {how or f'state {state}'} {where}")
    return out


def failure_point(ranks, records: dict[int, dict]) -> tuple:
    """Where an attempt failed on this node: the step the failed ranks (``ranks``: those that failed by
    themselves, not those the launcher killed) were in, or start-up, from their progress files."""
    recs = [records[r] for r in ranks if r in records]
    steps = [r["step"] for r in recs if r.get("phase") in ("step", "eval", "save")]
    return ("step", max(steps)) if steps else ("startup", None)
