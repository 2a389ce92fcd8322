"""Fixtures shared by the tests in this folder (helpers live in helpers.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def tiny_args(tmp_path) -> list[str]:
    """Flags for a fast single-process CPU run of a smaller-than-tiny model."""
    return ["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
            "--train_batch_size", "2", "--run_dir", str(tmp_path / "run")]
