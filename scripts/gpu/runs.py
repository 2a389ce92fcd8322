"""How verify.py runs things and keeps what they gave: the time box (one command with a limit, its log, and
nothing of it left running), the results file, the visit's Context, and the pytest plugin that records each
test as soon as it is over.

Time box: the command gets its own process group; at the limit the whole group is killed (SIGKILL: a training
run would answer SIGTERM by writing a checkpoint, time we do not have), and after a normal exit anything it
left behind (data-loader workers, torchrun children) is killed too, so that the next command finds the GPU free.

Results file: JSON lines, only ever appended to. Every record names the ``key`` (GPU architecture + library
versions, versions.key) it was measured under, the ``gpu`` it ran on, the ``unit`` it belongs to
(``train/llama3.2-1b/synthetic/te-fp8-current``, ``test:tests/...::name``, ...), its ``kind`` and ``status``. A
unit is *done* for a key when a record of it with a final status exists, a measurement (train, bench, profile)
only when it was made on the same GPU (a number from an H100 is not an H200's): the next command skips what is
done, so a visit cut short loses only the unit it was in. Final: passed, failed, skipped (pytest's), refused (a configuration that must be refused,
and was), timeout (the unit's own limit), error (the harness could not run it). Not final, tried again:
interrupted (the command's budget ran out inside the unit), unavailable (a precondition missing).

pytest plugin (``-p runs``, with scripts/gpu on PYTHONPATH): one record per test as soon as it is over, so a
run killed half-way keeps the outcomes it had, and the tests already recorded for this key are deselected.
Environment (set by steps.py): GPU_VERIFY_RESULTS (the results file), GPU_VERIFY_KEY, GPU_VERIFY_GPU (the GPU's
name), GPU_VERIFY_CURRENT (a file naming the running test: read after a kill), GPU_VERIFY_RETRY (1: run again the tests whose last record failed
or timed out), GPU_VERIFY_MIRROR (optional mirror folder).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import units

try:
    import pytest

    last_hook = pytest.hookimpl(trylast=True)
except ImportError:  # only the pytest step needs pytest (it loads this module as its plugin)
    def last_hook(f):
        return f


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
        _kill_group(proc.pid)
        proc.wait()
        if timed_out:
            fh.write(f"\n[timebox] killed after {timeout:.0f} s\n".encode())
    return Outcome(rc, timed_out, time.monotonic() - t0, log)



FINAL = frozenset({"passed", "failed", "skipped", "refused", "timeout", "error"})
RETRYABLE = frozenset({"failed", "timeout", "error"})  # what --retry runs again
MEASURED = frozenset({"train", "bench", "profile", "memory", "estimate"})  # kinds whose numbers belong to one GPU
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
    """Appends records to ``path`` (flushed and synced each time) and copies the whole file to
    ``mirror/<same name>`` after each append, so that the node's output folder $OUT always holds the latest."""

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
        """The whole results file into the mirror folder (also at a command's start: an output folder that comes
        back from a command that ran nothing still holds every record the node has)."""
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
    cache: dict = field(default_factory=dict)

    def run(self, name: str, cmd: list[str], deadline: float, extra_env: dict[str, str] | None = None
            ) -> tuple[Outcome, str | None]:
        """Run ``cmd`` until ``deadline`` (time.monotonic) or the budget's end. Returns the outcome and, if it
        was killed, the status that says why: timeout (its own limit) or interrupted (the budget)."""
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



MESSAGE_CHARS = 2000


def unit_of(nodeid: str) -> str:
    return f"test:{nodeid}"


class Recorder:
    def __init__(self, results: Path, key: str, gpu: str, current: Path | None, retry: bool, mirror: Path | None,
                 rootpath: Path):
        self.store = Store(results, mirror)
        self.rootpath = rootpath
        self.key, self.gpu = key, gpu
        self.current = current
        self.retry = retry
        self.reports: dict[str, list] = {}

    @last_hook
    def pytest_collection_modifyitems(self, config, items):
        recorded = done(self.store.records(), self.key, self.retry)
        keep = [i for i in items if unit_of(i.nodeid) not in recorded]
        dropped = [i for i in items if unit_of(i.nodeid) in recorded]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep

    def pytest_collectreport(self, report):
        if report.failed:  # a test file that does not even import: record it, it is a result too
            self._write(report.nodeid or "<collection>", "error", 0.0, _message(report), "collect")

    def pytest_runtest_logstart(self, nodeid, location):
        self.reports[nodeid] = []
        if self.current is not None:
            self.current.write_text(json.dumps({"nodeid": nodeid, "file": self.file_of(nodeid)}))

    def pytest_runtest_logreport(self, report):
        self.reports.setdefault(report.nodeid, []).append(report)
        if report.when == "teardown":
            self._finish(report.nodeid)

    def _finish(self, nodeid: str) -> None:
        reports = self.reports.pop(nodeid, [])
        status, message = "passed", ""
        for r in reports:
            if r.failed:
                status = "failed" if r.when == "call" else "error"
                message = _message(r)
                break
            if r.skipped:
                status, message = "skipped", _message(r)
        seconds = sum(r.duration for r in reports)
        self._write(nodeid, status, seconds, message, "run")
        if self.current is not None and self.current.exists():
            self.current.unlink()

    def file_of(self, nodeid: str) -> str:
        return str((self.rootpath / nodeid.split("::")[0]).resolve())

    def _write(self, nodeid: str, status: str, seconds: float, message: str, phase: str) -> None:
        self.store.append({"key": self.key, "gpu": self.gpu, "unit": unit_of(nodeid), "kind": "test", "nodeid": nodeid,
                           "file": self.file_of(nodeid), "status": status, "seconds": round(seconds, 2),
                           "message": message, "phase": phase})


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:MESSAGE_CHARS]
    text = str(report.longrepr or "")
    return text[-MESSAGE_CHARS:]


def pytest_configure(config):
    results = os.environ.get("GPU_VERIFY_RESULTS")
    if not results:
        return
    current = os.environ.get("GPU_VERIFY_CURRENT")
    mirror = os.environ.get("GPU_VERIFY_MIRROR")
    config.pluginmanager.register(
        Recorder(Path(results), os.environ["GPU_VERIFY_KEY"], os.environ.get("GPU_VERIFY_GPU", ""),
                 Path(current) if current else None,
                 os.environ.get("GPU_VERIFY_RETRY") == "1", Path(mirror) if mirror else None, config.rootpath),
        "gpu_verify_recorder")


def read_current(path: Path) -> dict | None:
    """The test that was running when the process was killed ({"nodeid", "file"}), if any."""
    return json.loads(path.read_text()) if path.is_file() and path.read_text().strip() else None
