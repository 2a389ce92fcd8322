"""The environment that gives a test run transformers' import table once (tests/startup/sitecustomize.py).

A module of its own, without torch: tests/conftest.py calls it at its import, in pytest's first process, before the
xdist workers start."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

STARTUP = str(Path(__file__).parent / "startup")
CACHE_ENV = "LLAMA_FP8_IMPORT_CACHE"


def use_import_cache(environ) -> str | None:
    """Put tests/startup first on ``environ``'s PYTHONPATH (once) and name a cache folder in it. Returns the folder it
    made, for the run to remove at its end; None where ``environ`` names a folder that exists (a worker, or a pytest
    started by a test: the run's folder). A named folder that does not exist (a host's, in a container) is replaced."""
    made = None
    if not os.path.isdir(environ.get(CACHE_ENV, "")):
        made = environ[CACHE_ENV] = tempfile.mkdtemp(prefix="llama-fp8-imports-")
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if STARTUP not in paths:
        environ["PYTHONPATH"] = os.pathsep.join([STARTUP, *paths])
    return made
