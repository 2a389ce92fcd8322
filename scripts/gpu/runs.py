"""How verify.py runs things: the time box (a limit, a log, the process group SIGKILLed), the results file, Context.

Results file: JSON lines, only appended to; each record names its ``key`` (versions.key), ``gpu``, ``unit``, ``kind``
and ``status``. A unit with a FINAL record for the key (a measurement: from the same GPU) is done; interrupted and
unavailable are tried again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import units


@dataclass(frozen=True)
class Outcome:
    returncode: int | None  # None: killed at the time limit
    timed_out: bool
    seconds: float
    log: Path

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.is_file() else ""


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
        return (left, True) if left is not None and left < own_limit else (own_limit, False)


def timebox(cmd: list[str], timeout: float, log: Path, env: dict[str, str] | None = None,
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
        try:  # the whole group, also after a normal exit: nothing it started may hold the GPU for the next command
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if timed_out:
            fh.write(f"\n[timebox] killed after {timeout:.0f} s\n".encode())
    return Outcome(rc, timed_out, time.monotonic() - t0, log)


FINAL = frozenset({"passed", "failed", "skipped", "refused", "timeout", "error"})
RETRYABLE = frozenset({"failed", "timeout", "error"})  # what --retry runs again
MEASURED = frozenset({"train", "memory", "estimate"})  # kinds whose numbers belong to one GPU
SCHEMA = 1


def load(path: Path) -> list[dict]:
    """All records; a line cut off by a kill (the last one, unparseable) is skipped with a warning."""
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"[results] {path}:{n}: not JSON (cut off?), skipped", file=sys.stderr)
    return out


def done(records: list[dict], key: str, retry: bool = False, gpu: str | None = None) -> set[str]:
    """Units with a final record for ``key``, measurements only from ``gpu`` when given (with ``retry``: minus
    those whose last record is retryable)."""
    last: dict[str, str] = {}
    for r in records:
        same_gpu = gpu is None or r.get("kind") not in MEASURED or r.get("gpu") == gpu
        if r.get("key") == key and r.get("status") in FINAL and "unit" in r and same_gpu:
            last[r["unit"]] = r["status"]
    return {u for u, s in last.items() if not (retry and s in RETRYABLE)}


def merge(returned: Path, local: Path) -> list[dict]:
    """Append to ``local`` the lines of ``returned`` it does not have; returns their records."""
    have = set(local.read_text().splitlines()) if local.exists() else set()
    new = [line for line in returned.read_text().splitlines() if line.strip() and line not in have]
    valid = []
    for line in new:
        try:
            valid.append((line, json.loads(line)))
        except json.JSONDecodeError:
            print(f"[results] skipped a line that is not JSON (cut off?): {line[:80]}", file=sys.stderr)
    if valid:
        local.parent.mkdir(parents=True, exist_ok=True)
        with open(local, "a") as f:
            if local.stat().st_size and not local.read_text().endswith("\n"):
                f.write("\n")
            f.writelines(line + "\n" for line, _ in valid)
    return [rec for _, rec in valid]


class Store:
    """Appends records to ``path`` (synced each time) and copies the file to ``mirror/`` after each append: the
    node's output folder $OUT always holds the latest."""

    def __init__(self, path: Path, mirror: Path | None = None):
        self.path = path
        self.mirror = mirror
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def records(self) -> list[dict]:
        return load(self.path)

    def append(self, record: dict) -> dict:
        assert "key" in record and "unit" in record and "status" in record, record
        record = {"schema": SCHEMA, **record}
        with open(self.path, "a+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(f.tell() - 1)
                if f.read(1) != "\n":  # the previous writer was killed mid-line: start a new one
                    f.write("\n")
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.copy_to_mirror()
        return record

    def copy_to_mirror(self) -> None:
        """The results file into the mirror folder (also at a command's start: every record the node has)."""
        if self.mirror is not None and self.path.is_file():
            self.mirror.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.path, self.mirror / self.path.name)


@dataclass
class Context:
    """One verify invocation: where things go, what it runs with, how long it may take."""

    repo: Path
    work: Path
    python: str
    store: Store
    key: str
    gpu: str
    opts: units.Options
    env: dict[str, str]
    budget: Budget
    mirror: Path | None = None
    retry: bool = False

    def run(self, name: str, cmd: list[str], deadline: float, extra_env: dict[str, str] | None = None
            ) -> tuple[Outcome, str | None]:
        """Run ``cmd`` until ``deadline`` (time.monotonic) or the budget's end; the outcome and, when killed, why:
        timeout (its own limit) or interrupted (the budget)."""
        limit, by_budget = self.budget.limit(max(deadline - time.monotonic(), 0.0))
        env = {**self.env, **(extra_env or {})}
        out = timebox(cmd, limit, self.work / "logs" / f"{name}.log", env, self.repo)
        killed = ("interrupted" if by_budget else "timeout") if out.timed_out else None
        return out, killed

    def train_cmd(self, flags: list[str]) -> list[str]:
        return [self.python, "-m", "llama_fp8", "train", *flags]


def slug(unit_id: str) -> str:
    """A unit id as a file name (letters, digits, '.', '_', '-': safe in the output folder that comes back)."""
    return unit_id.replace("/", "_").replace(":", "_")


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def failure(out: Outcome, killed: str | None, what: str) -> dict:
    """The record fields of a command that was killed (timeout / interrupted) or exited non-zero (failed)."""
    if killed:
        return {"status": killed, "message": f"{what}: killed after {out.seconds:.0f} s\n{out.tail(1500)}"}
    return {"status": "failed", "returncode": out.returncode, "message": f"{what}: exit {out.returncode}\n"
            f"{out.tail()}"}
