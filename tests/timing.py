"""Where the suite's time goes, test by test (a pytest plugin, loaded by tests/conftest.py).

With ``LLAMA_FP8_TEST_TIMES=PATH`` set, each test appends one JSON line to PATH:

- ``start``: when the test began (seconds since the epoch) and ``worker``: the pytest-xdist worker that ran it
  (``gw0``...; ``main`` without xdist): the run's timeline, to set beside the machine's idle time;
- ``wall_s``: setup + call + teardown; ``cpu_s``: CPU seconds of the test process and of every child process it
  waited for (their children too, when each level waits: torchrun's workers, a subprocess's own subprocesses);
  processes of a Slurm job are slurmd's children and not counted;
- ``fixtures``: seconds spent setting up shared (module/session) fixtures during this test's setup, by name: the
  first test that needs the local cluster or the image pays for them;
- ``runs``: the training attempts that wrote a goodput record under this test's ``tmp_path`` (metrics.jsonl: rank 0
  of each run), with their wall time split as the run itself measured it: ``imports`` (interpreter start to the end
  of the imports), the rest of ``startup`` (process group, model build, checkpoint load...), ``training`` (warm-up,
  productive steps, data wait, redone steps), ``checkpoints``, ``evaluation``.

``scripts/test_times.py`` turns the file into the table of docs/testing.md. Without the variable this plugin does
nothing but two clock reads per test.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import pytest

OUT_ENV = "LLAMA_FP8_TEST_TIMES"
_SHARED = ("module", "package", "session")
_OUT = pytest.StashKey[str]()


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _process_start() -> float:
    """When this process started (as goodput.process_start_time reads it): a run inside the test process has it."""
    from llama_fp8.telemetry.goodput import process_start_time

    return process_start_time()


def _runs(folder: Path, since: float, seen: set, here: float) -> list[dict]:
    """Goodput records of the attempts whose metrics.jsonl under ``folder`` changed during the test, each counted
    once per session (a test that copies another's run folder did not run it). A run inside the test process has
    its imports behind it: its "imports" part is the process's age, not an import, and is left out."""
    out = []
    for path in folder.rglob("metrics.jsonl"):
        try:
            if path.stat().st_mtime < since:
                continue
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            if '"goodput"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or rec.get("type") != "goodput":
                continue
            key = (rec.get("process_start"), rec.get("wall_s"), rec.get("step"))
            if key in seen:
                continue
            seen.add(key)
            parts = rec.get("startup_parts") or {}
            imports = float(parts.get("imports", 0.0))
            in_process = isinstance(rec.get("process_start"), (int, float)) and abs(rec["process_start"] - here) < 1
            # in this process, start-up is the run's own parts: its startup_s counts from the process's start, and
            # its first part after the imports ("process group") from the import of the module, sessions ago
            own = sum(float(v) for k, v in parts.items() if k not in ("imports", "process group")
                      and isinstance(v, (int, float)))
            out.append({
                "imports": 0.0 if in_process else imports,
                "startup": own if in_process else max(float(rec.get("startup_s", 0.0)) - imports, 0.0),
                "training": sum(float(rec.get(k, 0.0)) for k in ("warmup_s", "productive_s", "data_wait_s",
                                                                   "restart_loss_s")),
                "checkpoints": float(rec.get("checkpoint_sync_s", 0.0)) + float(rec.get("checkpoint_async_s", 0.0)),
                "evaluation": float(rec.get("evaluation_s", 0.0)),
            })
    return out


class Timer:
    def __init__(self, path: Path, worker: str):
        self.path, self.worker = path, worker
        self.current: dict | None = None
        self.tmp: Path | None = None
        self.seen: set = set()
        self.here = _process_start()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        t0 = time.monotonic()
        yield
        if self.current is not None and fixturedef.scope in _SHARED:
            fixtures = self.current["fixtures"]
            fixtures[fixturedef.argname] = round(fixtures.get(fixturedef.argname, 0.0) + time.monotonic() - t0, 2)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current, self.tmp = {"id": item.nodeid, "fixtures": {}, "outcome": "passed"}, None
        t0, c0, started = time.monotonic(), _cpu(), time.time()
        yield
        rec, self.current = self.current, None
        rec.update(start=round(started, 2), worker=self.worker,
                   wall_s=round(time.monotonic() - t0, 2), cpu_s=round(_cpu() - c0, 2))
        found = self.tmp is not None and self.tmp.is_dir()
        rec["runs"] = _runs(self.tmp, started - 1, self.seen, self.here) if found else []
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield
        tmp = (getattr(item, "funcargs", None) or {}).get("tmp_path")  # gone after teardown: read it now
        self.tmp = Path(tmp) if tmp is not None else None

    def pytest_runtest_logreport(self, report):
        if self.current is not None and report.outcome != "passed" and self.current["outcome"] == "passed":
            self.current["outcome"] = report.outcome


def pytest_configure(config):
    # The variable is for this test run only: taken out of the environment, so that a pytest a test starts (the
    # image's self-test, the mutation script's) neither writes its own tests into the file nor fails where the file
    # cannot be written (a container's read-only mount); xdist workers get it from the controller (below).
    out = getattr(config, "workerinput", {}).get(OUT_ENV) or os.environ.pop(OUT_ENV, None)
    if out:  # one line per test, appended in one write: several pytest processes may share the file
        config.stash[_OUT] = out
        # xdist's own id of this worker (not PYTEST_XDIST_WORKER: a pytest a test starts inherits that variable)
        worker = getattr(config, "workerinput", {}).get("workerid", "main")
        config.pluginmanager.register(Timer(Path(out), worker), "llama_fp8_timer")


@pytest.hookimpl(optionalhook=True)  # xdist's: a run without xdist has none
def pytest_configure_node(node):
    if _OUT in node.config.stash:
        node.workerinput[OUT_ENV] = node.config.stash[_OUT]
