"""What keeps the suite's hundreds of processes cheap, in the venv `make install` builds for it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cli_env


def test_the_training_venv_has_no_scipy():
    """transformers imports scipy.optimize at its own import wherever SciPy is installed (its object-detection loss):
    0.35 CPU s more for each training rank here, about 400 of them in a run of make test. The full mlflow package
    (the tests' tracking server) brings SciPy, so it lives in a venv of its own (the Makefile's MLFLOW_VENV)."""
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip(f"the check is of make install's venv ({REPO / '.venv'}); these tests run in {sys.prefix}")
    spec = importlib.util.find_spec("scipy")
    assert spec is None, (f"SciPy is installed in the training venv ({spec.origin}): which extra brought it? "
                          "Give a tool that needs it a venv of its own, as the MLflow server has")


PROBE = """
import json, os, sys, transformers
from transformers.utils import import_utils as iu
models = os.path.join(os.path.dirname(transformers.__file__), "models")
scan = iu.create_import_structure_from_path
fresh = getattr(scan, "__wrapped__", None)
print(json.dumps({"hooked": fresh is not None,
                  "same": fresh is not None and scan(models) == fresh(models),
                  "cached": sorted(os.listdir(os.environ["LLAMA_FP8_IMPORT_CACHE"])),
                  "has_llama": "LlamaForCausalLM" in dir(transformers)}))
"""


def probe(cache: Path) -> dict:
    """A Python process started as the tests start one (helpers.cli_env), with ``cache`` as the import cache."""
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                       env=cli_env(LLAMA_FP8_IMPORT_CACHE=str(cache)))
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_processes_the_tests_start_read_transformers_import_table_from_the_runs_cache(tmp_path):
    """tests/startup/sitecustomize.py: the first process scans and stores the table, the next reads it; both get
    transformers' own table (compared with a fresh scan in the same process) and transformers' names."""
    first = probe(tmp_path)
    assert first["hooked"] and first["same"] and first["has_llama"], first
    assert len(first["cached"]) == 1 and first["cached"][0].endswith(".json"), first
    stored = tmp_path / first["cached"][0]
    written = stored.stat().st_mtime_ns
    second = probe(tmp_path)
    assert second == first and stored.stat().st_mtime_ns == written  # read, not scanned and written again


@pytest.mark.parametrize("content", [b"{\"dirs\": {\"llama\": ", b"[1, 2]", b"\xff\xfe not json"],
                         ids=["half-written", "not-a-table", "not-text"])
def test_a_damaged_import_cache_is_scanned_again_and_replaced(tmp_path, content):
    name = probe(tmp_path)["cached"][0]
    (tmp_path / name).write_bytes(content)
    again = probe(tmp_path)
    assert again["same"] and again["has_llama"] and again["cached"] == [name], again
    assert json.loads((tmp_path / name).read_text())["dirs"]  # whole again: the scan's table


def test_a_gone_import_cache_folder_is_not_made_again(tmp_path):
    """A process that outlives its run (whose folder is removed at the end) scans and leaves nothing behind."""
    gone = tmp_path / "gone"
    r = subprocess.run([sys.executable, "-c", "import transformers; print(len(dir(transformers)) > 1000)"],
                       capture_output=True, text=True, timeout=120, env=cli_env(LLAMA_FP8_IMPORT_CACHE=str(gone)))
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
    assert not gone.exists() and not list(tmp_path.iterdir())


def test_the_suite_and_its_slurm_jobs_run_with_the_import_cache():
    """tests/conftest.py: the run's environment (so the workers', helpers.cli_env's and the Slurm jobs') has the
    startup folder on PYTHONPATH and a cache folder that exists."""
    startup = str(REPO / "tests" / "startup")
    assert startup in cli_env()["PYTHONPATH"].split(os.pathsep)
    assert Path(os.environ["LLAMA_FP8_IMPORT_CACHE"]).is_dir()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # make test's workers start after conftest.py set it: theirs too
        assert Path(sys.modules["sitecustomize"].__file__).parent == Path(startup)
    from slurm_helpers import startup_path

    assert startup_path() == [startup]
