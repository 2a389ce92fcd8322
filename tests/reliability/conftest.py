"""Fixtures of the fault matrix: the uninterrupted reference runs and the row recorder; with
LLAMA_FP8_RELIABILITY_DOC=PATH the session ends by rendering the matrix there (matrix.py)."""

from __future__ import annotations

import os

import faultkit
import matrix
import pytest


@pytest.fixture(scope="session")
def ref2(tmp_path_factory) -> faultkit.Reference:
    """The uninterrupted 2-rank run (6 steps, checkpoints at 2, 4, 6)."""
    return faultkit.reference(tmp_path_factory.mktemp("ref2") / "run", nproc=2)


@pytest.fixture(scope="session")
def ref1(tmp_path_factory) -> faultkit.Reference:
    """The uninterrupted 1-rank run, in-process."""
    return faultkit.reference(tmp_path_factory.mktemp("ref1") / "run", nproc=1)


@pytest.fixture
def row(request):
    """``row(observed, steps_lost)``: record this test's matrix row; call it last, after the asserts."""
    assert request.node.name in matrix.MATRIX, f"add {request.node.name} to tests/reliability/matrix.py MATRIX"
    return lambda observed, steps_lost: matrix.record(request.node.name, observed, steps_lost)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller renders, once every row is in
        return
    out = os.environ.get("LLAMA_FP8_RELIABILITY_DOC")
    if out and exitstatus == 0:
        rows = matrix.load_rows()
        missing = [k for k in matrix.MATRIX if k not in rows]
        if missing:
            print(f"\nreliability doc not written: {len(missing)} rows not recorded yet: {missing[:3]}")
        else:
            matrix.main(["--out", out])
