"""scripts/mutate.py: what its committed result keeps of a test's output."""

from __future__ import annotations

import importlib.util

from helpers import REPO

spec = importlib.util.spec_from_file_location("mutate", REPO / "scripts" / "mutate.py")
mutate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutate)


def test_a_results_detail_keeps_no_path_of_the_host_it_ran_on():
    """Before, tests/mutations-*.json held the run's temporary folders and the venv's absolute path."""
    out = ("FAILED tests/cluster/test_real_cluster.py::test_sbatch_requeues_on_exit_85 - ...\n"
           "E       job 1: device cpu, rendezvous 127.0.0.1:29501, venv /srv/build/repo/.venv\n"
           "E       assert 1 == 75 (run(PosixPath('/tmp/pytest-of-root/pytest-274/test_an_eio0') / 'b'))\n"
           "E       https://example.org/a/b stays a URL")
    got = mutate.without_hosts_paths(mutate.why_caught(out))
    assert "/srv" not in got and "/tmp" not in got, got
    assert "venv <path>/.venv" in got and "PosixPath('<path>/test_an_eio0')" in got
    assert got.startswith("FAILED tests/cluster/test_real_cluster.py::test_sbatch_requeues_on_exit_85")
    assert "127.0.0.1:29501" in got and "https://example.org/a/b" in got
