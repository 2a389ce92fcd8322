"""Run one command with a time limit, its output in a log file, and nothing of it left running afterwards.

The command gets its own process group (session): at the limit the whole group is killed (SIGKILL: a
training run would answer SIGTERM by writing a checkpoint, which is time we do not have), and after a normal
exit any process it left behind (data-loader workers, torchrun children) is killed too, so that the next
command finds the GPU free.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Outcome:
    returncode: int | None  # None: killed at the time limit
    timed_out: bool
    seconds: float
    log: Path

    def tail(self, chars: int = 3000) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return text[-chars:]


class Budget:
    """Seconds left for this invocation (None: no limit)."""

    def __init__(self, seconds: float | None, clock=time.monotonic):
        self._clock = clock
        self._end = None if seconds is None else clock() + seconds

    def left(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - self._clock())

    def limit(self, own_limit: float) -> tuple[float, bool]:
        """(seconds a unit may run, whether that is the budget's cut rather than the unit's own limit)."""
        left = self.left()
        if left is not None and left < own_limit:
            return left, True
        return own_limit, False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> Outcome:
    """Run ``cmd`` for at most ``timeout`` seconds; stdout and stderr go to ``log`` (rewritten: the tail read
    afterwards must be this command's own)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        fh.write(f"$ {' '.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 0.0))
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        _kill_group(proc.pid)
        proc.wait()
        if timed_out:
            fh.write(f"\n[timebox] killed after {timeout:.0f} s\n".encode())
    return Outcome(rc, timed_out, time.monotonic() - t0, log)
