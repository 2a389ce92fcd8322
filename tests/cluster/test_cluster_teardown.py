"""The session's cluster goes down after the last test that uses it (tests/cluster/conftest.py's
pytest_runtest_teardown), not at the end of the session: checked on a stand-in cluster fixture in a pytest of its
own, in one process and under xdist as `make test` runs it, and the rule on stand-in tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from slurm_helpers import cluster_needed_after, uses_the_cluster

HERE = Path(__file__).parent

CONFTEST = '''import importlib.util, os, sys
import pytest
sys.path.insert(0, {here!r})
spec = importlib.util.spec_from_file_location("cluster_conftest", os.path.join({here!r}, "conftest.py"))
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pytest_runtest_teardown = module.pytest_runtest_teardown  # the hook under test, and none of its fixtures
LOG = os.environ["TEARDOWN_LOG"]


def log(what):
    with open(LOG, "a") as f:
        f.write(what + "\\n")


@pytest.fixture(scope="session")
def cluster():
    log("cluster up")
    yield "the cluster"
    log("cluster down")


@pytest.fixture(scope="session")
def image(cluster):
    log("image built")
    yield "the image"
    log("image deleted")
'''
TESTS_A = '''from conftest import log

def test_job(cluster):
    log("job")

def test_container(image):
    log("container")
'''
TESTS_B = '''import pytest
from conftest import log

@pytest.mark.parametrize("cluster", ["a parameter, not the fixture"])
def test_other(cluster):
    log("other")
'''


@pytest.mark.parametrize("workers", [[], ["-n", "1", "--dist", "loadgroup"]], ids=["one-process", "xdist"])
def test_the_cluster_goes_down_after_its_last_test_before_the_next_one(tmp_path, workers):
    (tmp_path / "conftest.py").write_text(CONFTEST.format(here=str(HERE)))
    (tmp_path / "test_a.py").write_text(TESTS_A)
    (tmp_path / "test_b.py").write_text(TESTS_B)
    log = tmp_path / "log.txt"
    env = dict(os.environ, TEARDOWN_LOG=str(log), PYTHONPATH=str(HERE))
    env.pop("LLAMA_FP8_TEST_TIMES", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                        *workers, "test_a.py", "test_b.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    # the image (made from the cluster) first, then the cluster, both before the next test; nothing at the end
    assert log.read_text().splitlines() == ["cluster up", "job", "image built", "container", "image deleted",
                                            "cluster down", "other"]


def fake(name: str, fixtures=(), params=None, config=None, session=None):
    item = SimpleNamespace(name=name, fixturenames=list(fixtures), config=config, session=session)
    if params is not None:
        item.callspec = SimpleNamespace(params=params)
    return item


def test_a_parameter_named_cluster_is_not_the_cluster():
    assert uses_the_cluster(fake("a", ["cluster", "tmp_path"]))
    assert uses_the_cluster(fake("b", ["cluster"], params={"step": 3}))
    assert not uses_the_cluster(fake("c", ["cluster"], params={"cluster": "p5"}))
    assert not uses_the_cluster(fake("d", ["tmp_path"]))


@pytest.mark.parametrize("loadgroup, needed", [(True, False), (False, True)], ids=["loadgroup", "other"])
def test_an_xdist_worker_trusts_the_next_test_only_when_the_clusters_group_came_whole(loadgroup, needed):
    # xdist sets the worker's own option "loadgroup" from the controller's --dist (its "dist" there is "no")
    config = SimpleNamespace(workerinput={"workerid": "gw0"},
                             getoption=lambda name, default=None: {"loadgroup": loadgroup}[name])
    last, user = fake("last", ["cluster"], config=config), fake("user", ["cluster"], config=config)
    assert cluster_needed_after(last, user)  # the next test uses it, whatever the distribution
    assert cluster_needed_after(last, fake("other", ["tmp_path"], config=config)) is needed
    assert cluster_needed_after(last, None) is needed


def test_in_one_process_any_later_test_that_uses_it_keeps_it_up():
    config = SimpleNamespace()  # no workerinput: not an xdist worker
    session = SimpleNamespace(items=[])
    first, middle, later = (fake("first", ["cluster"], config=config, session=session),
                            fake("middle", ["tmp_path"], config=config, session=session),
                            fake("later", ["cluster"], config=config, session=session))
    session.items = [first, middle, later]
    assert cluster_needed_after(first, middle)  # `later` still needs it
    assert not cluster_needed_after(later, None)
    session.items = [first, middle]
    assert not cluster_needed_after(first, middle)
