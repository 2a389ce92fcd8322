"""Per-rank progress files for the launcher (cluster/launch/elastic.py): which step each rank is in.

``llama-fp8 launch`` gives its workers a private folder (``LLAMA_FP8_PROGRESS_DIR``); each rank keeps one
small file there, ``rank<R>.json``, rewritten as it moves through an attempt:

- ``startup``: built and resumed (``step`` is the step it resumed from);
- ``step``: at the start of every optimizer step, with ``step_s``, how long the previous step's own work took
  (from its ``step`` record to the next record: evaluation and saves are phases of their own);
- ``eval`` and ``save``: before a validation pass and before a checkpoint save of that step;
- ``finished``: after the last step, once the final checkpoint is complete (nothing is lost if a rank dies
  after this: a failure then is not restarted).

Every record also carries ``ckpt``, the step of the latest checkpoint this rank knows is complete (the launcher
reports it, and the batch script counts requeues without a new checkpoint from it). When a worker fails, the
launcher reads them to say which step was in progress (a step that fails again after a restart is not restarted
a second time) and which rank stopped moving while the others failed waiting for it.

A host-side write of a few dozen bytes per step: no device sync (the step number is the loop's own counter).
Without the environment variable (a plain run, torchrun) nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

ENV = "LLAMA_FP8_PROGRESS_DIR"
MAX_BYTES = 4096  # a progress file is ~120 bytes; anything larger is not ours
PHASES = ("startup", "step", "eval", "save", "finished")


class Heartbeat:
    """``beat(step, phase)``: record that this rank is in ``phase`` of ``step`` (no-op without ``ENV``).
    ``latest_checkpoint`` returns the step of the latest complete checkpoint (None: none yet)."""

    def __init__(self, rank: int, latest_checkpoint: Callable[[], int | None] = lambda: None):
        folder = os.environ.get(ENV)
        self.path = Path(folder) / f"rank{rank}.json" if folder else None
        self.rank, self.latest_checkpoint = rank, latest_checkpoint
        self.step_s: float | None = None
        self._phase, self._since = None, 0.0

    def beat(self, step: int, phase: str) -> None:
        if self.path is None:
            return
        now = time.time()
        if self._phase == "step":  # the step's own work ends where the next phase starts
            self.step_s = now - self._since
        self._phase, self._since = phase, now
        tmp = self.path.with_suffix(".tmp")
        try:  # rename: the launcher never reads half a file
            tmp.write_text(json.dumps({"rank": self.rank, "step": step, "phase": phase, "time": now,
                                       "pid": os.getpid(), "step_s": self.step_s,
                                       "ckpt": self.latest_checkpoint()}))
            tmp.replace(self.path)
        except OSError:
            self.path = None  # the folder went away (the launcher is gone): stop trying, training goes on


def read(folder: Path) -> dict[int, dict]:
    """rank -> its last progress record, for the files in ``folder`` that parse (others are skipped)."""
    out: dict[int, dict] = {}
    for path in sorted(folder.glob("rank*.json")):
        try:
            if path.stat().st_size > MAX_BYTES:
                continue
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("rank"), int) and isinstance(rec.get("step"), int):
            out[rec["rank"]] = rec
    return out


def number(rec: dict, key: str) -> float | None:
    """``rec[key]`` when it is a number (progress files are read as untrusted), else None."""
    value = rec.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
