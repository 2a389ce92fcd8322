"""How a command leaves (``llama_fp8/__main__.py``'s ``leave``): ``python -m llama_fp8`` and the ``llama-fp8`` script
exit without the garbage collections of Python's shutdown (the objects of the finished command frozen), and still do
what an exit must: the command's exit code, its standard output flushed, the atexit handlers run.

Seen from inside the process: a ``sitecustomize`` on the child's path registers the first atexit handler, so it runs
last, after the command has returned and left; it writes ``gc.get_freeze_count()`` to a file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cli_env, read_metrics

PROBE = '''import atexit, gc, os


def _report():  # the first atexit handler registered runs last: after the command's own
    with open(os.environ["EXIT_PROBE"], "w") as f:
        f.write(str(gc.get_freeze_count()))


atexit.register(_report)
'''


def run(tmp_path: Path, cmd: list[str]) -> tuple[subprocess.CompletedProcess, int]:
    """Run ``cmd`` with the probe; returns the result and the number of frozen objects at the last atexit handler."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(PROBE)
    probe = tmp_path / "frozen"
    probe.unlink(missing_ok=True)
    env = cli_env(EXIT_PROBE=str(probe))
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env.pop("PYTHONUNBUFFERED")  # stdout block-buffered into the pipe: leaving must still flush it
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    return r, int(probe.read_text())


def test_python_m_llama_fp8_leaves_frozen_with_its_exit_code_and_its_output(tmp_path):
    r, frozen = run(tmp_path, [sys.executable, "-m", "llama_fp8", "--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage: llama-fp8 {train,") and \
        r.stdout.rstrip().endswith("lists the flags of a command."), r.stdout
    assert frozen > 1000, frozen  # every object alive when the command returned
    r, frozen = run(tmp_path, [sys.executable, "-m", "llama_fp8", "no-such-command"])
    assert r.returncode == 2 and "unknown command 'no-such-command'" in r.stderr and frozen > 0


def test_the_console_script_leaves_the_same_way(tmp_path):
    (entry,) = re.findall(r'^llama-fp8 = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)  # [project.scripts]
    module, func = entry.split(":")
    code = f"import sys\nfrom {module} import {func}\nsys.argv = ['llama-fp8', 'no-such-command']\n{func}()"
    r, frozen = run(tmp_path, [sys.executable, "-c", code])
    assert r.returncode == 2 and "unknown command" in r.stderr and frozen > 0, (r.stderr, frozen)


@pytest.mark.slow
def test_a_training_run_leaves_frozen_with_its_records_and_last_line(tmp_path):
    run_dir = tmp_path / "run"
    r, frozen = run(tmp_path, [sys.executable, "-m", "llama_fp8", "train", "--model", "tiny", "--device", "cpu",
                               "--num_layers", "1", "--max_context_width", "32", "--max_steps", "2",
                               "--checkpoint_freq", "2", "--run_dir", str(run_dir)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.rstrip().splitlines()[-1] == f"Training finished: 2 steps, run dir {run_dir}"
    assert frozen > 10_000
    recs = read_metrics(run_dir)
    assert [x["step"] for x in recs if x["type"] == "train"] == [1, 2] and recs[-1]["type"] == "goodput"
    assert (run_dir / "checkpoints" / "step_2" / "COMPLETE").exists()
