"""Per-rank progress files for the launcher (cluster/elastic.py): which step each rank is in.

``llama-fp8 launch`` gives its workers a private folder (``LLAMA_FP8_PROGRESS_DIR``); each rank keeps one
small file there, ``rank<R>.json``, rewritten when it starts (``phase: startup``, with the step it resumes
from) and at the start of every optimizer step (``phase: step``). When a worker fails, the launcher reads
them to say which step was in progress (a step that fails again after a restart is not restarted a second
time) and which rank stopped moving while the others failed waiting for it.

A host-side write of a few dozen bytes per step: no device sync (the step number is the loop's own counter).
Without the environment variable (a plain run, torchrun) nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

ENV = "LLAMA_FP8_PROGRESS_DIR"
MAX_BYTES = 4096  # a progress file is ~80 bytes; anything larger is not ours


class Heartbeat:
    """``beat(step, phase)``: record that this rank is in ``phase`` of ``step`` (no-op without ``ENV``)."""

    def __init__(self, rank: int):
        folder = os.environ.get(ENV)
        self.path = Path(folder) / f"rank{rank}.json" if folder else None
        self.rank = rank

    def beat(self, step: int, phase: str) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:  # rename: the launcher never reads half a file
            tmp.write_text(json.dumps({"rank": self.rank, "step": step, "phase": phase, "time": time.time(),
                                       "pid": os.getpid()}))
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
