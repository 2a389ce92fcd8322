"""pytest plugin (``-p pytest_record``, with scripts/gpu on PYTHONPATH) that appends one results record per
test as soon as the test is over, so that a run killed half-way keeps the outcomes it had, and that
deselects the tests already recorded for this GPU and versions.

Environment (set by verify.py): GPU_VERIFY_RESULTS (the results file), GPU_VERIFY_KEY (gpu_versions.key),
GPU_VERIFY_CURRENT (a file naming the test that is running: verify reads it after a kill), GPU_VERIFY_RETRY
(1: run again the tests whose last record failed or timed out), GPU_VERIFY_MIRROR (optional mirror folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gpu_results
import pytest

MESSAGE_CHARS = 2000


def unit_of(nodeid: str) -> str:
    return f"test:{nodeid}"


class Recorder:
    def __init__(self, results: Path, key: str, current: Path | None, retry: bool, mirror: Path | None,
                 rootpath: Path):
        self.store = gpu_results.Store(results, mirror)
        self.rootpath = rootpath
        self.key = key
        self.current = current
        self.retry = retry
        self.reports: dict[str, list] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        done = gpu_results.done(self.store.records(), self.key, self.retry)
        keep = [i for i in items if unit_of(i.nodeid) not in done]
        dropped = [i for i in items if unit_of(i.nodeid) in done]
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
        self.store.append({"key": self.key, "unit": unit_of(nodeid), "kind": "test", "nodeid": nodeid,
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
        Recorder(Path(results), os.environ["GPU_VERIFY_KEY"], Path(current) if current else None,
                 os.environ.get("GPU_VERIFY_RETRY") == "1", Path(mirror) if mirror else None, config.rootpath),
        "gpu_verify_recorder")


def read_current(path: Path) -> dict | None:
    """The test that was running when the process was killed ({"nodeid", "file"}), if any."""
    return json.loads(path.read_text()) if path.is_file() and path.read_text().strip() else None
