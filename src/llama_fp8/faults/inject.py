"""Fault injection for tests and drills, inert unless its environment variable is set.

``LLAMA_FP8_FAULT`` injects a process fault at a named point of a run, on one rank or all::

    LLAMA_FP8_FAULT="ACTION@POINT[:step=N][:rank=R][:node=NAME][:seconds=S][:once]"   (several: separated by ";")

ACTION is ``kill`` (SIGKILL this process: a crash or an OOM kill), ``eio`` (an OSError EIO: a network file
system failing for a moment), ``hang`` (stop making progress, as a
rank stuck in a kernel or a dead network link; only SIGKILL ends it), ``stop`` (SIGSTOP this process: a rank
frozen dead, deaf to every signal but SIGKILL), ``raise`` (an exception: the rank exits 1), ``sleep``
(``seconds``, then go on: a slow rank) or ``pause`` (announce ``$LLAMA_FP8_FAULT_DIR/paused.POINT.rankR``, then wait until
``$LLAMA_FP8_FAULT_DIR/release`` exists: a test can act at that exact moment). ``once`` fires only if
``$LLAMA_FP8_FAULT_DIR/fired.POINT.rankR[.stepN]`` does not exist yet, and creates it (a requeued job runs
clean); with ``node``, once for that node (``fired.POINT.node-NAME[.stepN]``), whichever rank it has. POINT is one of ``POINTS``. Without ``step`` the fault fires at every pass through the point (once with
``once``), without ``rank`` on every rank, with ``node`` only on the node Slurm calls NAME (``SLURMD_NODENAME``:
a bad node).
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger("llama_fp8.faults")

FAULT_NAN_ENV = "LLAMA_FP8_FAULT_NAN_AT_STEP"
"""Fault injection for tests and drills: make the loss NaN at this step."""
FAULT_ENV = "LLAMA_FP8_FAULT"
"""Fault injection for tests and drills: kill, hang, slow down or pause a rank at a point (module docstring)."""
FAULT_DIR_ENV = "LLAMA_FP8_FAULT_DIR"
"""Where ``pause`` announces itself and waits for ``release``, and where ``once`` remembers a fired fault."""
POINTS = {
    "startup": "start-up: built and resumed, before the first step",
    "data": "the loader: before a micro-batch is fetched (counted as this rank's data wait: a slow input pipeline)",
    "step": "the middle of an optimizer step: after the forward pass, before the backward pass",
    "save.files_written": "a save: this rank's own files written, before the sharded model/optimizer write",
    "save.shards_written": "a save: this rank's shards written and checksummed, before the ranks agree that "
                           "all are (so before the COMPLETE marker)",
    "save.marker_written": "a save: every rank's files written; rank 0 has written COMPLETE in step_N.tmp, "
                           "before the rename to step_N",
    "save.renamed": "a save (rank 0): step_N complete under its final name, before older checkpoints are deleted",
    "save.pruning": "a save (rank 0): an old checkpoint renamed for deletion, before its files are deleted",
    "save.async_in_flight": "an async save: state staged, the background write under way, training resumes",
    "save.uploading": "an S3 save: this rank's first shard object part-way uploaded (its first bytes sent, the "
                      "upload not finished)",
    "checkpoint.read": "a checkpoint load: before a file of model and optimizer shards is read (the read is "
                       "retried on a transient I/O error)",
    "finished": "the last step done, its checkpoint complete and `finished` reported to the launcher, before the "
                "process ends (a crash in teardown)",
}
ACTIONS = ("kill", "eio", "hang", "stop", "raise", "sleep", "pause")


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    step: int | None = None
    rank: int | None = None
    node: str | None = None
    seconds: float = 0.0
    once: bool = False


def parse_faults(text: str) -> list[Fault]:
    """``LLAMA_FP8_FAULT``'s value -> faults; a ValueError names what is wrong (a typo must not be inert)."""
    out = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        head, *opts = spec.split(":")
        action, _, point = head.partition("@")
        if action not in ACTIONS or point not in POINTS:
            raise ValueError(f"{FAULT_ENV}={text!r}: {spec!r} is not ACTION@POINT with ACTION in {ACTIONS} and "
                             f"POINT in {sorted(POINTS)}")
        kw: dict = {}
        for opt in opts:
            key, _, value = opt.partition("=")
            if key in ("step", "rank"):
                kw[key] = int(value)
            elif key == "node" and value:
                kw[key] = value
            elif key == "seconds":
                kw[key] = float(value)
            elif key == "once" and not value:
                kw[key] = True
            else:
                raise ValueError(f"{FAULT_ENV}={text!r}: unknown option {opt!r} (step=N, rank=R, node=NAME, "
                                 f"seconds=S, once)")
        out.append(Fault(action, point, **kw))
    return out


_holding = False


def holding() -> bool:
    """Whether this process is held by a ``pause`` fault: a test acting at that moment, not a hang (the progress
    thread counts it as progress: telemetry/heartbeat.py)."""
    return _holding


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def at(point: str, step: int | None = None) -> None:
    """A fault injection point: does nothing unless ``LLAMA_FP8_FAULT`` names it (one environment lookup)."""
    assert point in POINTS, point
    text = os.environ.get(FAULT_ENV)
    if not text:
        return
    rank = _rank()
    for f in parse_faults(text):
        if f.point != point or (f.step is not None and f.step != step) or (f.rank is not None and f.rank != rank):
            continue
        if f.node is not None and f.node != os.environ.get("SLURMD_NODENAME"):
            continue
        folder = Path(os.environ.get(FAULT_DIR_ENV, "."))
        if f.once:
            at_step = '' if f.step is None else f'.step{f.step}'
            marker = folder / f"fired.{point}.rank{rank}{at_step}"
            # a node's fault fires once for the node: its rank changes when a step starts again or a spare joins
            node = folder / f"fired.{point}.node-{f.node}{at_step}" if f.node is not None else None
            if marker.exists() or (node is not None and node.exists()):
                continue
            marker.touch()
            if node is not None:
                node.touch()
        _fire(f, rank, step, folder)


def _fire(f: Fault, rank: int, step: int | None, folder: Path) -> None:
    log.warning("fault injection (%s): %s at %s, step %s, rank %d", FAULT_ENV, f.action, f.point, step, rank)
    for h in logging.getLogger().handlers:
        h.flush()
    if f.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif f.action == "eio":
        raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (fault injection at {f.point}, rank {rank})")
    elif f.action == "raise":
        raise RuntimeError(f"fault injection ({FAULT_ENV}): an error at {f.point}, step {step}, rank {rank}")
    elif f.action == "sleep":
        time.sleep(f.seconds)
    elif f.action == "pause":
        global _holding
        (folder / f"paused.{f.point}.rank{rank}").touch()
        deadline = time.monotonic() + 600
        _holding = True
        try:
            while not (folder / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            _holding = False
    else:  # hang: signals only set flags (SignalWatch); only SIGKILL (torchrun, Slurm) ends it
        while True:
            time.sleep(1)
