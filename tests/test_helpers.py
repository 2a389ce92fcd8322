"""The test helpers that start child processes: what those children inherit."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO, cli_env


def test_cli_env_puts_src_first_and_keeps_the_callers_pythonpath(tmp_path, monkeypatch):
    """A node without network installs Transformer Engine / torchao into a folder on PYTHONPATH; a child started
    by the tests must still import from there (and take this checkout's package first)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "installed_beside.py").write_text("VALUE = 42\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{tmp_path / 'other'}")
    env = cli_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO / "src"), str(site), str(tmp_path / "other")]
    code = "import installed_beside, llama_fp8; print(installed_beside.VALUE, llama_fp8.__file__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    value, where = out.stdout.split()
    assert value == "42" and where.startswith(str(REPO / "src"))


def test_cli_env_without_a_pythonpath_gives_src_alone(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert cli_env()["PYTHONPATH"] == str(REPO / "src")


def test_the_test_process_and_its_children_run_one_openmp_thread():
    """tests/conftest.py: one intra-op thread in the test process (three workers share two cores), as in the children."""
    import torch

    if os.environ.get("OMP_NUM_THREADS") not in (None, "1"):  # the caller chose: conftest keeps it
        assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
        return
    assert torch.get_num_threads() == 1 and cli_env()["OMP_NUM_THREADS"] == "1"
