"""Signals (Slurm preemption / time limit) and non-finite values, detected without per-step device syncs;
fault injection hooks for tests and drills (inert unless their environment variable is set).

``LLAMA_FP8_FAULT`` injects a process fault at a named point of a run, on one rank or all::

    LLAMA_FP8_FAULT="ACTION@POINT[:step=N][:rank=R][:seconds=S][:once]"   (several: separated by ";")

ACTION is ``kill`` (SIGKILL this process: a crash or an OOM kill), ``hang`` (stop making progress, as a
rank stuck in a kernel or a dead network link; only SIGKILL ends it), ``stop`` (SIGSTOP this process: a rank
frozen dead, deaf to every signal but SIGKILL), ``raise`` (an exception: the rank exits 1), ``sleep``
(``seconds``, then go on: a slow rank) or ``pause`` (announce ``$LLAMA_FP8_FAULT_DIR/paused.POINT.rankR``, then wait until
``$LLAMA_FP8_FAULT_DIR/release`` exists: a test can act at that exact moment). ``once`` fires only if
``$LLAMA_FP8_FAULT_DIR/fired.POINT.rankR`` does not exist yet, and creates it (a requeued job runs clean).
POINT is one of ``POINTS``. Without ``step`` the fault fires at every pass through the point (once with
``once``), without ``rank`` on every rank.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

FAULT_NAN_ENV = "LLAMA_FP8_FAULT_NAN_AT_STEP"
"""Fault injection for tests and drills: make the loss NaN at this step."""
FAULT_ENV = "LLAMA_FP8_FAULT"
"""Fault injection for tests and drills: kill, hang, slow down or pause a rank at a point (module docstring)."""
FAULT_DIR_ENV = "LLAMA_FP8_FAULT_DIR"
"""Where ``pause`` announces itself and waits for ``release``, and where ``once`` remembers a fired fault."""
POINTS = {
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
    "finished": "the last step done, its checkpoint complete and `finished` reported to the launcher, before the "
                "process ends (a crash in teardown)",
}
ACTIONS = ("kill", "hang", "stop", "raise", "sleep", "pause")


@dataclass(frozen=True)
class Fault:
    action: str
    point: str
    step: int | None = None
    rank: int | None = None
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
            elif key == "seconds":
                kw[key] = float(value)
            elif key == "once" and not value:
                kw[key] = True
            else:
                raise ValueError(f"{FAULT_ENV}={text!r}: unknown option {opt!r} (step=N, rank=R, seconds=S, once)")
        out.append(Fault(action, point, **kw))
    return out


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
        folder = Path(os.environ.get(FAULT_DIR_ENV, "."))
        if f.once:
            marker = folder / f"fired.{point}.rank{rank}"
            if marker.exists():
                continue
            marker.touch()
        _fire(f, rank, step, folder)


def _fire(f: Fault, rank: int, step: int | None, folder: Path) -> None:
    log.warning("fault injection (%s): %s at %s, step %s, rank %d", FAULT_ENV, f.action, f.point, step, rank)
    for h in logging.getLogger().handlers:
        h.flush()
    if f.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif f.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif f.action == "raise":
        raise RuntimeError(f"fault injection ({FAULT_ENV}): an error at {f.point}, step {step}, rank {rank}")
    elif f.action == "sleep":
        time.sleep(f.seconds)
    elif f.action == "pause":
        (folder / f"paused.{f.point}.rank{rank}").touch()
        deadline = time.monotonic() + 600
        while not (folder / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:  # hang: signals only set flags (SignalWatch); only SIGKILL (torchrun, Slurm) ends it
        while True:
            time.sleep(1)


class Preempted(Exception):
    """SIGUSR1/SIGTERM arrived; a checkpoint was saved at ``step``."""

    def __init__(self, step: int):
        super().__init__(f"stopped by signal after step {step}; checkpoint saved, requeue to resume")
        self.step = step


class NonFinite(Exception):
    """A non-finite loss or gradient norm (the message names the first such step)."""


class SignalWatch:
    """Sets a flag on SIGUSR1/SIGTERM; ``requested()`` agrees on it across ranks.

    Slurm may deliver the signal to some ranks before others, so every rank must take the same decision
    at the same step: a MAX all-reduce of the flag on a CPU (gloo) group each step. It synchronizes host
    threads only, never the GPU, and costs microseconds next to a training step."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, world_size: int):
        self._flag = False
        self._group = dist.new_group(backend="gloo", timeout=collective_timeout()) if world_size > 1 else None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if not self._flag:
            log.warning("received %s: finishing this step, then saving a checkpoint", signal.Signals(signum).name)
        else:
            log.warning("received %s again: already stopping (the checkpoint is being saved)",
                        signal.Signals(signum).name)
        self._flag = True

    def requested(self) -> bool:
        if self._group is None:
            return self._flag
        t = torch.tensor([1 if self._flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item())

    def close(self) -> None:
        """Give the signals back, unless one arrived: then the process is on its way out with the requeue
        code, and a repeated signal (Slurm sends SIGTERM at the time limit after the USR1 warning; an
        operator may signal twice) must not kill it before it exits - the default action of both signals
        is to terminate, which would turn exit code 85 into a signal death and lose the requeue. SIG_IGN
        (not a Python handler) also holds through interpreter shutdown, which resets Python handlers.

        Without a signal, the previous handlers come back, except a default SIGUSR1: Slurm's time-limit warning
        can land after the last step, while the run tears down; nothing is left to save then, and its default
        action would turn a finished run into a signal death (a FAILED job, srun's "User defined signal 1")."""
        for s, handler in self._previous.items():
            late_warning = s == signal.SIGUSR1 and handler == signal.SIG_DFL
            signal.signal(s, signal.SIG_IGN if self._flag or late_warning else handler)


class NanGuard:
    """Tracks the first step with a non-finite loss/grad norm on the device; read only when asked."""

    def __init__(self, device: torch.device, policy: str, max_skips: int):
        self.policy, self.max_skips, self.skipped = policy, max_skips, 0
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        inject = os.environ.get(FAULT_NAN_ENV)
        self.inject_step = int(inject) if inject else None

    def maybe_inject(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Fault injection in the middle of a step (after the forward pass): a NaN loss
        (``LLAMA_FP8_FAULT_NAN_AT_STEP``) or a process fault at point ``step`` (``LLAMA_FP8_FAULT``)."""
        at("step", step)
        return loss * float("nan") if step == self.inject_step else loss

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Device-side bookkeeping: no sync."""
        bad = ~torch.isfinite(loss.detach())
        if grad_norm is not None:
            bad = bad | ~torch.isfinite(grad_norm.detach())
        self._first_bad = torch.where(bad & (self._first_bad < 0), step, self._first_bad)

    def step_is_bad(self, grad_norm: torch.Tensor) -> bool:
        """--nan_policy skip: decide now (a host sync, paid only under this policy). The gradient norm is
        global (reduced over ranks), and a NaN loss on any rank makes it NaN, so every rank agrees."""
        bad = not torch.isfinite(grad_norm).item()
        if bad:
            self.skipped += 1
            if self.skipped > self.max_skips:
                raise NonFinite(f"{self.skipped} steps had a non-finite loss or gradient norm (limit "
                                f"--max_nan_skips {self.max_skips})")
        return bad

    def check(self) -> None:
        """Raise if any step so far was non-finite (one sync: call on logging and checkpoint steps)."""
        never = 2**62
        first = torch.where(self._first_bad >= 0, self._first_bad, never)
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank must stop together
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        first = int(first.item())
        if first < never:
            raise NonFinite(f"non-finite loss or gradient norm at step {first}; stopping without saving "
                            f"(the last complete checkpoint is intact). Lower --lr, check the data, or use "
                            f"--nan_policy skip")
