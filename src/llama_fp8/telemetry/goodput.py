"""Goodput: where one attempt of a run spent its wall time, and ``goodput = productive / wall``.

Parts (seconds, measured on rank 0 with ``time.perf_counter``; they add up to the wall time but for the
loop's own bookkeeping, which is folded into the step it belongs to):

- ``startup``: process start (the kernel's start time of this process) to the first step: imports, the
  process group, model build, checkpoint load, loaders.
- ``warmup``: the steps of the attempt's first logging window, less their data wait: they hold
  ``torch.compile`` and allocator warm-up (the report leaves this window out of every speed figure).
- ``productive``: every later step, less its data wait.
- ``data_wait``: time the loop blocked on the data loader.
- ``checkpoint_sync``: synchronous saves; ``checkpoint_async``: the part of async saves the loop waits for
  (staging, and finishing the previous save).
- ``evaluation``: validation passes.
- ``restart_loss``: steps redone after a resume (steps this run's metrics.jsonl already logged before the
  checkpoint it resumed from was written), less their data wait.

A requeued run writes one ``goodput`` record per attempt; the time spent queued between attempts is
nobody's wall time here. Each record also says how the attempt ``ended`` (``finished``; ``signal``: a stop
asked by SIGUSR1/SIGTERM, saved; ``failed``) and how many checkpoint ``saves`` it made (the report's cost of
one save is checkpoint time / saves).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path

PARTS = ("startup", "warmup", "productive", "data_wait", "checkpoint_sync", "checkpoint_async", "evaluation",
         "restart_loss")
_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """Epoch seconds at which this process started (Linux /proc, to the kernel's clock tick), else when this module
    was imported. The start is counted in ticks since boot (proc(5), field 22 of /proc/self/stat), on the clock of
    ``CLOCK_BOOTTIME``: now less the time since it. (The boot time of /proc/stat is in whole seconds: a start read
    from it was up to a second early.)"""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime), counted after the ")" of the name
        since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux: no CLOCK_BOOTTIME, no /proc
        return _IMPORTED_AT


class StartupParts:
    """Where this process's start-up went: ``mark(name)`` at named moments, each part the wall time since the
    previous mark (the first from the process's start: the interpreter and the imports). The goodput record and
    the log's start-up line carry them; the restart benchmark breaks a restart down with them."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._last = process_start_time()

    def mark(self, name: str) -> None:
        now = time.time()
        self.parts[name] = self.parts.get(name, 0.0) + max(now - self._last, 0.0)
        self._last = now

    def line(self) -> str:
        total = sum(self.parts.values())
        return f"start-up {total:.1f} s: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in self.parts.items())


startup = StartupParts()
"""This process's start-up (one per process: the training code marks it as it goes, train/cli.py, train/state.py)."""


def _tail(path: Path, max_bytes: int) -> str | None:
    """The file's last ``max_bytes`` as text (a hostile or huge file costs no more than that); None if unreadable."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - max_bytes))
            return f.read(max_bytes).decode("utf-8", errors="replace")
    except OSError:
        return None


def last_logged_step(metrics_path: Path, max_bytes: int = 64 << 20) -> int:
    """The highest train step an earlier attempt logged in metrics.jsonl (0 if none); reads at most the
    file's last ``max_bytes`` (a hostile or huge file costs no more than that)."""
    text = _tail(metrics_path, max_bytes)
    if text is None:
        return 0
    last = 0
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("type") == "train" and isinstance(rec.get("step"), int):
            last = max(last, rec["step"])
    return last


def earlier_attempts(metrics_path: Path, max_bytes: int = 64 << 20) -> int:
    """How many attempts of this run came before this one (a restart inside the allocation and a requeue alike): each
    attempt's meta record in metrics.jsonl counts, the last one with its own count (``restarts``) + 1 when it has one.
    Reads at most the file's last ``max_bytes``."""
    text = _tail(metrics_path, max_bytes)
    if text is None:
        return 0
    count, last = 0, None
    for line in text.splitlines():
        if not line.startswith('{"type": "meta"'):  # json.dumps writes "type" first; skip parsing the rest
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        count, last = count + 1, rec
    restarts = last.get("restarts") if isinstance(last, dict) else None
    return restarts + 1 if isinstance(restarts, int) and not isinstance(restarts, bool) and restarts >= 0 else count


def _count(env, var: str) -> int:
    try:
        return int(env.get(var) or 0)
    except ValueError:
        return 0


STEP_AGAIN_ENV = "LLAMA_FP8_STEP_AGAIN"
"""1: the batch script started the training step again in the same allocation (a node left behind for a spare of
the allocation, or a restart in place): the same job continues, as after a requeue."""


def written_by_this_job(metrics_path: Path, env: dict[str, str] | None = None, max_bytes: int = 1 << 20) -> bool:
    """Whether the first attempt recorded in ``metrics_path`` was an earlier attempt of this same job, which this one
    may continue in place: a restart inside the allocation (an attempt > 0 of this launch: ``LLAMA_FP8_ATTEMPT``
    from ``llama-fp8 launch``, else torchrun's ``TORCHELASTIC_RESTART_COUNT``) with the same torchrun run id, or a
    requeue (``SLURM_RESTART_COUNT`` > 0) or a training step started again (``STEP_AGAIN_ENV``) of the same Slurm
    job. A first attempt never is, whatever its ids match:
    torchrun's run id is "none" for every run without --rdzv_id, and two runs in one allocation (salloc, or one
    batch script training twice) share the job id. Reads at most ``max_bytes``."""
    env = os.environ if env is None else env
    try:
        with metrics_path.open("rb") as f:
            first = f.read(max_bytes).decode("utf-8", errors="replace").split("\n", 1)[0]
        rec = json.loads(first)
    except (OSError, ValueError):
        return False
    repro = rec.get("repro") if isinstance(rec, dict) and rec.get("type") == "meta" else None
    if not isinstance(repro, dict):
        return False
    attempt = _count(env, "LLAMA_FP8_ATTEMPT") if "LLAMA_FP8_ATTEMPT" in env else \
        _count(env, "TORCHELASTIC_RESTART_COUNT")
    restarted = attempt > 0 and bool(env.get("TORCHELASTIC_RUN_ID")) and \
        repro.get("elastic_run_id") == env.get("TORCHELASTIC_RUN_ID")
    requeued = (_count(env, "SLURM_RESTART_COUNT") > 0 or env.get(STEP_AGAIN_ENV) == "1") and \
        bool(env.get("SLURM_JOB_ID")) and repro.get("slurm_job_id") == env.get("SLURM_JOB_ID")
    return restarted or requeued


class Goodput:
    """The clock of one attempt; ``begin`` at the first step, ``end_step`` after each, ``timed`` around
    evaluation and checkpoints, ``record`` at the end."""

    def __init__(self, start_step: int, first_log_step: int, redo_until: int, async_checkpoint: bool):
        self.start_step, self.first_log_step, self.redo_until = start_step, first_log_step, redo_until
        self.checkpoint_part = "checkpoint_async" if async_checkpoint else "checkpoint_sync"
        self.parts = dict.fromkeys(PARTS, 0.0)
        self._proc_start = process_start_time()
        self._t_loop = self._inside = None
        self.last_step = start_step
        self.saves = 0  # checkpoint saves this attempt made (the loop counts them)
        self.ended = "failed"  # the loop sets "finished", or "signal" for a stop asked by SIGUSR1/SIGTERM

    def begin(self) -> None:
        self._t_loop = time.perf_counter()
        self.parts["startup"] = max(time.time() - self._proc_start, 0.0)
        self._t_step = self._t_loop

    @contextlib.contextmanager
    def timed(self, part: str):
        """Charge the block to ``part`` (and not to the step it runs in)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.parts[part] += dt
            self._inside = (self._inside or 0.0) + dt

    def end_step(self, step: int, data_wait: float) -> None:
        """Close step ``step``: its time since the previous step's end, less timed blocks and data wait."""
        now = time.perf_counter()
        work = max(now - self._t_step - (self._inside or 0.0) - data_wait, 0.0)
        part = ("restart_loss" if step <= self.redo_until else "warmup" if step <= self.first_log_step
                else "productive")
        self.parts[part] += work
        self.parts["data_wait"] += data_wait
        self._t_step, self._inside, self.last_step = now, None, step

    def so_far(self) -> float | None:
        """Goodput up to now (the window records carry it)."""
        wall = self.wall()
        return self.parts["productive"] / wall if wall > 0 else None

    @property
    def begun(self) -> bool:
        return self._t_loop is not None

    def wall(self) -> float:
        return self.parts["startup"] + (time.perf_counter() - self._t_loop if self._t_loop else 0.0)

    def record(self) -> dict:
        wall = self.wall()
        return {"type": "goodput", "step": self.last_step, "start_step": self.start_step, "wall_s": wall,
                **{f"{k}_s": v for k, v in self.parts.items()},
                "goodput": self.parts["productive"] / wall if wall > 0 else None, "saves": self.saves,
                "ended": self.ended, "startup_parts": dict(startup.parts), "process_start": self._proc_start}


def restart_gaps(records: list[dict]) -> list[float]:
    """Seconds from the last step an attempt logged to the first step the next attempt logged, for every restart
    after a failure (inside the allocation or a requeue) in one run's records, in file order: failure detection,
    the restart, start-up and the steps redone up to the first logged one. An attempt that ended on a stop
    signal (its goodput record: ``ended`` "signal") was requeued on purpose: the gap after it (the queue) is not
    counted. Records without a ``time`` are skipped."""
    gaps, last, pending, planned = [], None, False, False
    for rec in records:
        kind = rec.get("type")
        if kind == "goodput":
            planned = rec.get("ended") == "signal"
        elif kind == "meta":
            pending, planned = last is not None and not planned, False
        elif kind == "train" and isinstance(rec.get("time"), (int, float)):
            if pending:
                gaps.append(max(rec["time"] - last, 0.0))
                pending = False
            last = rec["time"]
    return gaps


def checkpoint_interval(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (seconds of training between saves) that maximizes goodput when a save blocks
    training ``save_s`` and failures arrive ``mtbf_s`` apart on average: Daly's higher-order estimate (J. T. Daly,
    "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22, 2006), which refines
    Young's sqrt(2 * save * MTBF) (J. W. Young, CACM 17, 1974); the MTBF itself once a save costs half of it."""
    if save_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"save cost and MTBF must be > 0 (got {save_s}, {mtbf_s})")
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    r = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - save_s


def expected_loss_per_failure(interval_s: float, restart_s: float) -> float:
    """Seconds one failure costs on average: half an interval of work redone (a failure falls anywhere in it) and
    the restart itself (detection, restart, start-up)."""
    return interval_s / 2 + restart_s


def summary_line(rec: dict) -> str:
    """The log's end summary: ``Goodput: 71.2 % of 123.4 s wall (start-up 9.1 s, ...)``."""
    parts = ", ".join(f"{k.replace('_', ' ')} {rec[f'{k}_s']:.1f} s" for k in PARTS)
    g = rec["goodput"]
    return f"Goodput: {'n/a' if g is None else f'{100 * g:.1f} %'} of {rec['wall_s']:.1f} s wall ({parts})"


def first_log_step(start_step: int, logging_freq: int, max_steps: int) -> int:
    """The first logging step of an attempt that starts after ``start_step``."""
    nxt = (start_step // logging_freq + 1) * logging_freq
    return min(nxt, max_steps)
