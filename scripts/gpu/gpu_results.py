"""The results file of GPU visits: JSON lines, only ever appended to.

Every record names the ``key`` (GPU + versions, gpu_versions.key) it was measured under, the ``unit`` it
belongs to (``train/llama3.2-1b/synthetic/te-fp8-delayed``, ``test:tests/...::name``, ...), its ``kind`` and
``status``. A unit is *done* for a key when a record of it with a final status exists: the next visit on the
same GPU and versions skips it, so a visit cut short loses only the unit it was in.

Statuses: passed, failed, skipped (pytest's), refused (a configuration that must be refused, and was),
timeout (the unit's own time limit), error (the harness could not run it) are final; interrupted (the
command's budget ran out inside the unit) and unavailable (a precondition missing, e.g. a trainer flag) are
not, and are tried again.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

FINAL = frozenset({"passed", "failed", "skipped", "refused", "timeout", "error"})
NOT_FINAL = frozenset({"interrupted", "unavailable"})
RETRYABLE = frozenset({"failed", "timeout", "error"})  # what --retry runs again
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


def done(records: list[dict], key: str, retry: bool = False) -> set[str]:
    """Units with a final record for ``key`` (with ``retry``: minus those whose last record is retryable)."""
    last: dict[str, str] = {}
    for r in records:
        if r.get("key") == key and r.get("status") in FINAL and "unit" in r:
            last[r["unit"]] = r["status"]
    return {u for u, s in last.items() if not (retry and s in RETRYABLE)}


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
        if self.mirror is not None:
            self.mirror.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.path, self.mirror / self.path.name)
        return record
