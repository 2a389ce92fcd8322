"""The GPU bring-up scripts (scripts/gpu/) are plain scripts, not a package: put their folder on sys.path
so that the tests import their modules as the scripts themselves do."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts" / "gpu"
HERE = Path(__file__).resolve().parent
for path in (SCRIPTS, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
