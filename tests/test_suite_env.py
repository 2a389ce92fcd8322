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
scanned = fresh.cache_info().misses if hasattr(fresh, "cache_info") else None  # before the comparison's own scan
import sitecustomize
print(json.dumps({"hooked": getattr(scan, "import_cache", None) == os.environ["LLAMA_FP8_IMPORT_CACHE"],
                  "scanned": scanned,
                  "same": fresh is not None and sitecustomize.same(scan(models), fresh(models)),
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
    assert first["scanned"] > 500, first  # the models folder and each model's own: transformers' scan ran
    assert len(first["cached"]) == 1 and first["cached"][0].endswith(".json"), first
    stored = tmp_path / first["cached"][0]
    written = stored.stat().st_mtime_ns
    second = probe(tmp_path)
    assert second["scanned"] == 0, second  # read: transformers' scan never ran
    assert second == {**first, "scanned": 0} and stored.stat().st_mtime_ns == written  # and not written again


def import_cache():
    """tests/startup/sitecustomize.py as a module of its own (loaded so, it installs no hook), and a counting
    transformers scan with the models folder it is for."""
    import transformers
    from transformers.utils import import_utils

    spec = importlib.util.spec_from_file_location("import_cache", REPO / "tests" / "startup" / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    scan = getattr(import_utils.create_import_structure_from_path, "__wrapped__",
                   import_utils.create_import_structure_from_path)  # transformers' own (lru-cached in this process)
    calls = []

    def counted(path):
        calls.append(str(path))
        return scan(path)

    counted.__wrapped__ = scan
    return module, counted, calls, str(Path(transformers.__file__).parent / "models")


HEADER = '"format": "llama-fp8 tests: transformers import table, 1"'


@pytest.mark.parametrize("content", [
    f'{{{HEADER}, "entries": [["dir", "llama", ', '[1, 2]', b"\xff\xfe not json", '{"dirs": {}, "files": []}',
    f'{{{HEADER}, "entries": []}}', f'{{{HEADER}, "entries": [["file", ["torch"], {{"modeling_llama": "LlamaModel"}}]]}}',
    f'{{{HEADER}, "entries": [["dir", "llama", [["file", "torch", {{"modeling_llama": ["LlamaModel"]}}]]]]}}'],
    ids=["half-written", "not-a-table", "not-text", "another-format", "empty-table", "names-not-a-list",
         "backends-not-a-list"])
def test_a_damaged_or_foreign_import_cache_is_scanned_again_and_replaced(tmp_path, content):
    """What the hook reads is checked: anything but a table of the form it writes means transformers' own scan,
    whose table is stored again."""
    cache, scan, calls, models = import_cache()
    where = Path(cache.cache_file(str(tmp_path), models))
    where.write_bytes(content if isinstance(content, bytes) else content.encode())
    got = cache.cached(scan, str(tmp_path))(models)
    assert calls == [models]  # scanned
    assert cache.same(got, scan.__wrapped__(models))
    assert cache.same(cache.decode(json.loads(where.read_text())["entries"]), got)  # whole again: the scan's table
    assert cache.same(cache.cached(scan, str(tmp_path))(models), got) and calls == [models]  # then read


@pytest.mark.parametrize("odd", [{"llama": {frozenset({"torch"}): {"modeling_llama": {"LlamaModel"}}}, 3: {}},
                                 {"llama": {frozenset({"torch"}): {"modeling_llama": {1}}}}],
                         ids=["a-key-of-another-type", "a-name-not-a-string"])
def test_a_table_that_cannot_be_stored_exactly_is_not_stored(tmp_path, odd):
    """Another transformers' table of a shape the hook does not know is scanned by every process, never changed."""
    cache, _, _, models = import_cache()
    assert cache.cached(lambda path: odd, str(tmp_path))(models) is odd
    assert not list(tmp_path.iterdir())


def test_a_gone_import_cache_folder_is_not_made_again(tmp_path):
    """A process that outlives its run (whose folder is removed at the end) scans and leaves nothing behind."""
    cache, scan, calls, models = import_cache()
    gone = tmp_path / "gone"
    assert cache.same(cache.cached(scan, str(gone))(models), scan.__wrapped__(models)) and calls == [models]
    assert not gone.exists() and not list(tmp_path.iterdir())


def test_a_run_names_its_own_cache_folder_unless_it_is_given_one_that_exists(tmp_path):
    """tests/import_cache_env.py, as tests/conftest.py calls it: a folder that exists is the run's (a worker's, a
    nested pytest's); an unset one or one that does not exist here (a host's folder named in a container) is made
    anew; the startup folder goes first on PYTHONPATH once, what was there kept."""
    from import_cache_env import STARTUP, use_import_cache

    env = {"PYTHONPATH": "/a:/b"}
    made = use_import_cache(env)
    try:
        assert made and Path(made).is_dir() and env["LLAMA_FP8_IMPORT_CACHE"] == made
        assert env["PYTHONPATH"].split(os.pathsep) == [STARTUP, "/a", "/b"]
        assert use_import_cache(env) is None and env["LLAMA_FP8_IMPORT_CACHE"] == made  # given, exists: kept
        assert env["PYTHONPATH"].split(os.pathsep) == [STARTUP, "/a", "/b"]
    finally:
        os.rmdir(made)
    host = {"LLAMA_FP8_IMPORT_CACHE": str(tmp_path / "not-here")}
    other = use_import_cache(host)
    try:
        assert other and Path(other).is_dir() and host["LLAMA_FP8_IMPORT_CACHE"] == other
        assert host["PYTHONPATH"] == STARTUP
    finally:
        os.rmdir(other)


def test_the_suite_and_its_slurm_jobs_run_with_the_import_cache():
    """tests/conftest.py: the run's environment (so the workers', helpers.cli_env's and the Slurm jobs') has the
    startup folder on PYTHONPATH and a cache folder that exists."""
    from import_cache_env import STARTUP as startup

    assert startup in cli_env()["PYTHONPATH"].split(os.pathsep)
    assert Path(os.environ["LLAMA_FP8_IMPORT_CACHE"]).is_dir()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # make test's workers start after conftest.py set it: theirs too
        assert Path(sys.modules["sitecustomize"].__file__).parent == Path(startup)
    from slurm_helpers import startup_path

    assert startup_path() == [startup]
