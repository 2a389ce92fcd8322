"""What keeps the suite's hundreds of processes cheap, in the venv `make install` builds for it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from helpers import REPO


def test_the_training_venv_has_no_scipy():
    """transformers imports scipy.optimize at its own import wherever SciPy is installed (its object-detection loss):
    0.35 CPU s more for each training rank here, about 400 of them in a run of make test. The full mlflow package
    (the tests' tracking server) brings SciPy, so it lives in a venv of its own (the Makefile's MLFLOW_VENV)."""
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip(f"the check is of make install's venv ({REPO / '.venv'}); these tests run in {sys.prefix}")
    spec = importlib.util.find_spec("scipy")
    assert spec is None, (f"SciPy is installed in the training venv ({spec.origin}): which extra brought it? "
                          "Give a tool that needs it a venv of its own, as the MLflow server has")
