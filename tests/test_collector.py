"""The garbage collector at start-up and exit (``llama_fp8/collector.py``): no collection while a command imports its
modules or training starts up, and ``python -m llama_fp8`` and the ``llama-fp8`` script leave without the collections
of Python's shutdown (the objects of the finished command frozen), still doing what an exit must: the command's exit
code, its standard output flushed, the atexit handlers run.

Seen from inside the process: a ``sitecustomize`` on the child's path counts the collections of each generation
(``gc.callbacks``) and registers the first atexit handler, so that it runs last, after the command has returned and
left; it writes ``gc.get_freeze_count()`` and the counts to a file."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cli_env, read_metrics
from llama_fp8 import collector

PROBE = '''import atexit, gc, os

collections = [0, 0, 0]


def _count(phase, info):
    if phase == "start":
        collections[info["generation"]] += 1


def _report():  # the first atexit handler registered runs last: after the command's own
    with open(os.environ["EXIT_PROBE"], "w") as f:
        f.write(" ".join(map(str, [gc.get_freeze_count(), *collections])))


gc.callbacks.append(_count)
atexit.register(_report)
'''


def run(tmp_path: Path, cmd: list[str]) -> tuple[subprocess.CompletedProcess, int, list[int]]:
    """Run ``cmd`` with the probe; returns the result, the number of objects frozen at the last atexit handler and
    the collections of each generation up to then."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(PROBE)
    probe = tmp_path / "frozen"
    probe.unlink(missing_ok=True)
    env = cli_env(EXIT_PROBE=str(probe))
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env.pop("PYTHONUNBUFFERED")  # stdout block-buffered into the pipe: leaving must still flush it
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    frozen, *collections = map(int, probe.read_text().split())
    return r, frozen, collections


def test_python_m_llama_fp8_leaves_frozen_with_its_exit_code_and_its_output(tmp_path):
    r, frozen, _ = run(tmp_path, [sys.executable, "-m", "llama_fp8", "--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage: llama-fp8 {train,") and \
        r.stdout.rstrip().endswith("lists the flags of a command."), r.stdout
    assert frozen > 1000, frozen  # every object alive when the command returned
    r, frozen, _ = run(tmp_path, [sys.executable, "-m", "llama_fp8", "no-such-command"])
    assert r.returncode == 2 and "unknown command 'no-such-command'" in r.stderr and frozen > 0


def test_the_console_script_leaves_the_same_way(tmp_path):
    (entry,) = re.findall(r'^llama-fp8 = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)  # [project.scripts]
    module, func = entry.split(":")
    code = f"import sys\nfrom {module} import {func}\nsys.argv = ['llama-fp8', 'no-such-command']\n{func}()"
    r, frozen, _ = run(tmp_path, [sys.executable, "-c", code])
    assert r.returncode == 2 and "unknown command" in r.stderr and frozen > 0, (r.stderr, frozen)


@pytest.mark.slow
def test_a_training_run_starts_without_collections_and_leaves_frozen_with_its_records(tmp_path):
    """Before: 916, 84 and 6 collections of generations 0, 1 and 2 in this run, nearly all of them in its start-up
    (each walking what the imports had made); now a few dozen young ones, in its steps."""
    run_dir = tmp_path / "run"
    r, frozen, collections = run(tmp_path, [
        sys.executable, "-m", "llama_fp8", "train", "--model", "tiny", "--device", "cpu", "--num_layers", "1",
        "--max_context_width", "32", "--max_steps", "2", "--checkpoint_freq", "2", "--run_dir", str(run_dir)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.rstrip().splitlines()[-1] == f"Training finished: 2 steps, run dir {run_dir}"
    assert collections[2] == 0 and sum(collections) < 100, collections
    assert frozen > 10_000
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs if x["type"] == "train"] == [1, 2] and recs[-1]["type"] == "goodput"
    assert (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists()


def test_paused_holds_every_collection_and_restores_the_collector_as_it_was():
    seen = []

    def count(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    def garbage() -> None:  # cycles: only a collection frees them
        for _ in range(20_000):
            a: list = []
            a.append(a)

    was = gc.isenabled()
    gc.callbacks.append(count)
    try:
        gc.enable()
        with collector.paused():
            assert not gc.isenabled()
            seen.clear()  # one may have run on the way in, before the collector was off
            garbage()
            inside = list(seen)
        assert inside == [] and gc.isenabled()
        seen.clear()
        garbage()
        assert seen  # the same allocations, the collector on: it ran
        gc.disable()
        with collector.paused():
            pass
        assert not gc.isenabled()  # off before: off after
        gc.enable()
        with pytest.raises(ValueError), collector.paused():
            raise ValueError
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        if was:
            gc.enable()
        else:
            gc.disable()


def test_paused_freezes_what_it_made_only_in_the_program(monkeypatch):
    """A call into the package from another program (this test process) never freezes its objects: they would never
    be collected again. ``python -m llama_fp8`` freezes the modules a command imported (test above: the counts)."""
    before = gc.get_freeze_count()  # what the test session froze (conftest.py), if anything
    with collector.paused(freeze=True):
        kept = [object() for _ in range(1000)]
    assert gc.get_freeze_count() == before
    monkeypatch.setattr(collector, "_program", True)
    try:
        with collector.paused(freeze=True):
            kept = [[] for _ in range(1000)]
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()
        if before:
            gc.freeze()  # the session's freeze back (this test's lists with it: a few kB)
