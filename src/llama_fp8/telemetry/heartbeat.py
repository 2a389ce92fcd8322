"""Per-rank progress files for the launcher (cluster/launch/elastic.py, watchdog.py): where each rank is, and since
when it has not moved.

``llama-fp8 launch`` gives its workers a private folder (``LLAMA_FP8_PROGRESS_DIR``); each rank keeps one small
file there, ``rank<R>.json``, rewritten as it moves through an attempt (``PHASES``):

- ``startup``: from the process's first line of training code (``step`` 0), then again once built and resumed
  (``step``: the step it resumed from);
- ``step``: at the start of every optimizer step; ``data`` while a step has waited more than ``DATA_AFTER_S`` for
  the data loader (a slow input pipeline or a Hub stream reconnecting is not a hang of the rank);
- ``eval`` and ``save``: before a validation pass and before a checkpoint save of that step;
- ``finished``: after the last step, once the final checkpoint is complete (nothing is lost if a rank dies
  after this: a failure then is not restarted).

Fields: ``time`` the rank's last progress (a phase, a step, a collective issued, the end of a data wait); ``since``
the start of the phase; ``step_s`` the previous step's own work and ``step_max_s`` the longest of the last
``RECENT_STEPS`` (evaluation and saves are phases of their own); ``took`` the last duration of each other phase
(``first_step``: the attempt's first step, with its warm-up; ``eval``; ``save``; ``startup``) and ``expect`` what the
run knew before it started (``save``: the save time its checkpoint recorded); ``ckpt`` the step of the latest
checkpoint this rank knows is complete; ``seq`` the collectives this rank has issued, per process group (torch's
sequence numbers: in SPMD every rank issues the same collectives in the same order, so the rank the others wait
for is the one behind); ``alive`` the last write of the progress thread (a stopped process stops writing);
``error`` the class and line of the failure that ends the rank, written just before it exits.

A thread (``start_watch``) refreshes ``seq`` and ``alive`` every ``TICK_S`` while the training thread may be
blocked in a collective, and answers the launcher's request to dump NCCL's (or gloo's) flight recorder
(``DUMP_REQUEST`` in the folder; the dump goes where ``TORCH_FR_DUMP_TEMP_FILE`` points, as torch's own dump
on a timeout). Host-side writes of a few hundred bytes to /dev/shm: no device sync. Without the environment
variable (a plain run, torchrun) nothing is written and no thread runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from llama_fp8.faults import inject

ENV = "LLAMA_FP8_PROGRESS_DIR"
MAX_BYTES = 16384  # a progress file is ~400 bytes; anything larger is not ours
PHASES = ("startup", "step", "data", "eval", "save", "finished")
RECENT_STEPS = 20
"""Steps whose longest duration is the rank's recent step time (``step_max_s``): a logging step's sync is in it."""
TICK_S = 0.5
"""How often the progress thread looks at the collectives issued and for a dump request."""
DATA_AFTER_S = 1.0
"""A step that has waited this long for the data loader shows the phase ``data``."""
DUMP_REQUEST = "dump"
"""The file the launcher creates in the progress folder to ask every rank for its flight recorder's dump."""


def collective_counts() -> dict[str, int]:
    """Process group name -> the collectives this rank has issued on it (torch's sequence numbers: they count at
    issue, on gloo and NCCL alike); {} before a process group exists."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {}
    out = {}
    for group, name in list(dist.distributed_c10d._world.pg_names.items()):
        try:
            out[str(name)] = int(group._get_sequence_number_for_group())
        except (RuntimeError, AttributeError, ValueError, TypeError):
            continue
    return out


def dump_flight_record(rank: int) -> str | None:
    """This rank's flight recorder (the last ``TORCH_FR_BUFFER_SIZE`` collectives of every group, as torch dumps
    them on a timeout) written to ``$TORCH_FR_DUMP_TEMP_FILE<rank>``; its path, or None when the recorder is off
    or the dump failed. Read with ``python -m torch.distributed.flight_recorder.fr_trace``."""
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if not prefix or not int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0):
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        data = _dump_fr_trace(includeCollectives=True, includeStackTraces=False, onlyActive=False)
        path = Path(f"{prefix}{rank}")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        return str(path)
    except (ImportError, RuntimeError, OSError, ValueError):
        return None


def pending_collectives() -> dict[str, list]:
    """From the flight recorder: process group -> [the oldest unfinished collective's sequence number, its state]
    (``scheduled``, ``started``); {} when the recorder is off. On NCCL a rank whose GPU is stuck in a kernel has
    its next collective scheduled while its peers' same one has started (gloo does not track the states)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        entries = json.loads(_dump_fr_trace_json(includeCollectives=True, onlyActive=True)).get("entries") or []
    except (ImportError, RuntimeError, ValueError, AttributeError):
        return {}
    out: dict[str, list] = {}
    for e in entries:
        group, seq = e.get("process_group"), e.get("collective_seq_id")
        if e.get("is_p2p") or not isinstance(seq, int) or not isinstance(group, list) or not group:
            continue
        name = str(group[0])
        if name not in out or seq < out[name][0]:
            out[name] = [seq, str(e.get("state"))]
    return out


class Heartbeat:
    """``beat(step, phase)``: record that this rank is in ``phase`` of ``step`` (no-op without ``ENV``).
    ``latest_checkpoint`` returns the step of the latest complete checkpoint (None: none yet)."""

    def __init__(self, rank: int, latest_checkpoint: Callable[[], int | None] = lambda: None):
        folder = os.environ.get(ENV)
        self.folder = Path(folder) if folder else None
        self.path = self.folder / f"rank{rank}.json" if folder else None
        self.rank, self.latest_checkpoint = rank, latest_checkpoint
        self.step_s: float | None = None
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)
        now = time.time()
        self._rec: dict = {"rank": rank, "step": 0, "phase": "startup", "time": now, "since": now,
                           "pid": os.getpid(), "step_s": None, "step_max_s": None, "took": {}, "expect": {},
                           "ckpt": None, "seq": {}, "alive": now}
        self._phase, self._since, self._steps = "startup", now, 0
        self._lock = threading.Lock()
        self._data_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dumped = False

    # --- the training thread --------------------------------------------------------------------------------
    def beat(self, step: int, phase: str) -> None:
        if self.path is None:
            return
        now = time.time()
        with self._lock:
            took = self._rec["took"]
            if self._phase == "step":  # the step's own work ends where the next phase starts
                self.step_s = now - self._since
                self._steps += 1
                if self._steps == 1:
                    took["first_step"] = self.step_s
                else:  # the first step holds compilation and warm-up: not a measure of the steps after it
                    self._recent.append(self.step_s)
            elif self._phase in ("eval", "save") or (self._phase == "startup" and phase != "startup"):
                took[self._phase] = now - self._since
            if phase != "startup" or self._phase != "startup":
                self._phase, self._since = phase, now
            self._rec.update(step=step, phase=phase, time=now, since=self._since, step_s=self.step_s,
                             step_max_s=max(self._recent) if self._recent else None, ckpt=self.latest_checkpoint())
            self._write()

    def expect(self, phase: str, seconds: float | None) -> None:
        """What this run knows of a phase's duration before measuring it (a save time recorded by its checkpoint)."""
        if seconds is not None and self.path is not None:
            with self._lock:
                self._rec["expect"][phase] = float(seconds)

    @contextlib.contextmanager
    def data_wait(self):
        """Around a fetch from the data loader: the progress thread shows a long wait as the phase ``data``."""
        self._data_since = time.time()
        try:
            yield
        finally:
            self._data_since = None

    def failed(self, kind: str | None, line: str) -> None:
        """The failure that ends this rank (its class, or None, and one line): written before the process exits."""
        if self.path is None:
            return
        with self._lock:
            self._rec["error"] = {"kind": kind, "line": line[:500]}
            self._write()

    # --- the progress thread --------------------------------------------------------------------------------
    def start_watch(self) -> None:
        """Start the progress thread (once the process groups exist; more may come later, it looks each time)."""
        if self.path is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="llama-fp8-progress", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * TICK_S)

    def _watch(self) -> None:
        while not self._stop.wait(TICK_S) and self.path is not None:
            self.tick()

    def tick(self) -> None:
        """One look: the collectives issued (a change is progress), a long data wait, a dump request."""
        seq, now = collective_counts(), time.time()
        with self._lock:
            rec = self._rec
            if seq != rec["seq"] or inject.holding():  # a test's pause is not a hang
                rec["seq"], rec["time"] = seq, now
            waiting = self._data_since
            if waiting is not None and now - waiting > DATA_AFTER_S and rec["phase"] == "step":
                rec["phase"] = "data"
            elif waiting is None and rec["phase"] == "data":  # the data came: the step goes on
                rec["phase"], rec["time"] = "step", now
            rec["alive"] = now
            self._write()
        if not self._dumped and self.folder is not None and (self.folder / DUMP_REQUEST).exists():
            self._dumped = True
            path = dump_flight_record(self.rank)
            pending = pending_collectives() if path else {}
            with self._lock:
                self._rec["dumped"] = path or "none"
                if pending:
                    self._rec["fr"] = pending
                self._write()

    def _write(self) -> None:
        """Rewrite the file (caller holds the lock); rename: the launcher never reads half a file."""
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self._rec))
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
    value = rec.get(key) if isinstance(rec, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
