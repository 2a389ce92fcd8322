"""Fixtures of the checkpoint tests: a run stopped after step 4 (complete checkpoints step_2 and step_4),
saved once per module and copied for each test."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from ckpt_kit import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))  # the matrix and its renderer
import matrix  # noqa: E402


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    b = tmp_path_factory.mktemp("saved") / "b"
    assert run(b, "--max_steps", "4", "--checkpoint_freq", "2") == 0
    return b


@pytest.fixture
def saved(saved_once, tmp_path):
    """A fresh copy of a run stopped after step 4: complete checkpoints step_2 and step_4."""
    b = tmp_path / "b"
    shutil.copytree(saved_once, b, symlinks=True)
    return b


@pytest.fixture
def hostile(request):
    """``hostile(observed)``: record this test's row of the hostile-inputs table; call it last, after the
    asserts."""
    assert request.node.name in matrix.HOSTILE, f"add {request.node.name} to tests/reliability/matrix.py HOSTILE"
    return lambda observed: matrix.record_hostile(request.node.name, observed)
