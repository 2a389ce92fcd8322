"""scripts/gpu/ and scripts/offline/ hold plain scripts, not packages: put their folders (and this one, for
kit_fakes) on sys.path so that the tests import their modules as the scripts themselves do."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
for path in (REPO / "scripts" / "gpu", REPO / "scripts" / "offline", Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
