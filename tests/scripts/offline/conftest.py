"""scripts/offline/ holds plain scripts: put its folder on sys.path so that the tests import kit.py."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts" / "offline"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
