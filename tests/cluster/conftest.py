"""Fixtures for the launcher tests: a real three-node Slurm on this host (see slurm_helpers.py), with Pyxis, Enroot
and a registry when the session runs container tests (see container_helpers.py)."""

from __future__ import annotations

import shutil

import pytest
from container_helpers import (
    ImageBuild,
    build_project_image,
    build_small_base,
    build_standin,
    builder_env,
    prune_storage,
)
from slurm_helpers import cluster_needed_after, local_cluster, make_job_env, unavailable, uses_the_cluster

# Why the session's cluster has no containers, when it has none (the container tests skip with it; under CI they fail).
_NO_CONTAINERS: list[str] = []


def _runs_container_tests(session) -> bool:
    return any(item.get_closest_marker("container") for item in session.items)


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    """A three-node cluster (n1, n2, n3 on this host) for the whole session: the jobs take two nodes, the third lets
    a job leave a node behind; every daemon stopped by PID after. With container tests in the session it also runs
    Pyxis + Enroot and a registry (one cluster for every test: the slurmd ports are fixed); without the container
    kit it comes up without them and those tests skip."""
    container = _runs_container_tests(request.session)
    root = tmp_path_factory.mktemp("slurm")
    try:
        try:
            c = local_cluster.up(root, nodes=3, container=container)
        except local_cluster.container_kit.KitMissing as e:
            _NO_CONTAINERS.append(str(e))
            c = local_cluster.up(root, nodes=3)
    except local_cluster.ClusterUnavailable as e:
        unavailable(str(e))
    pids = dict(c.pids)
    yield c
    left = local_cluster.down(c)
    alive = {name: pid for name, pid in pids.items() if local_cluster.alive(pid)}
    assert not alive, f"daemons still running after tear-down: {alive}"
    assert not left, f"left behind after tear-down: {left}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The cluster (and what was made on it: the images, their Enroot state) goes down after the last test that uses
    it, not when the session ends: its tear-down (cancelling, stopping the daemons, removing every node's containers,
    10-20 s) then runs beside the other workers' tests instead of after them, at the end of the run. Through pytest's
    own FixtureDef.finish, which tears down the fixtures made from the cluster first, as at the session's end; where
    a pytest lacks the attributes used, the cluster goes down at the session's end as before."""
    result = yield
    if uses_the_cluster(item) and not cluster_needed_after(item, nextitem):
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).get("cluster")
        request = getattr(item, "_request", None)
        if definitions and request is not None:
            definitions[-1].finish(request)
    return result


@pytest.fixture(scope="session")
def fault_reference(cluster, tmp_path_factory):
    """The uninterrupted two-node job (one rank a node, test_faults_slurm.py's flags) that the faulted jobs of
    test_faults_slurm.py and test_spares_slurm.py must end equal to: one job for both files (it ran once in each).
    A long wait: beside the other tests, a busy two-core machine can take minutes to start its launchers."""
    from test_faults_slurm import uninterrupted

    return uninterrupted(cluster, tmp_path_factory.mktemp("reference"), timeout=2400)


@pytest.fixture
def job_env(cluster):
    """Environment for sbatch/srun clients: cluster conf, repo code, quiet single-threaded torch."""
    return make_job_env(cluster)


@pytest.fixture(scope="session")
def pyxis(cluster):
    """The session's cluster, which has Pyxis + Enroot on its nodes and a registry (else the test skips, and fails
    under CI=true: a CI run must not land with its container tests silently skipped)."""
    if not cluster.container:
        unavailable("no containers on the local Slurm cluster: " +
                    (_NO_CONTAINERS[0] if _NO_CONTAINERS else "the cluster was started without containers"))
    return cluster


@pytest.fixture(scope="session")
def build_env(pyxis):
    """Environment for the image builders and `enroot import` on the submitting host (the cluster's "head")."""
    return builder_env(pyxis)


@pytest.fixture(scope="session")
def standin_base(build_env) -> str:
    """The stand-in for the NGC base, built once and kept by the builder (cached across sessions by its key)."""
    return build_standin(build_env)


@pytest.fixture(scope="session")
def project_image(build_env, standin_base, tmp_path_factory) -> ImageBuild:
    """0.transformer-engine.dockerfile built for real on the stand-in by scripts/build_image.sh (buildah, the image
    archive path) into an Enroot image shared by every container test; deleted at the end (~2 GB)."""
    folder = tmp_path_factory.mktemp("image")
    build = build_project_image(build_env, standin_base, folder / "llama-fp8.sqsh")
    yield build
    shutil.rmtree(folder, ignore_errors=True)
    prune_storage(build_env, [build.log], standin_base)


@pytest.fixture(scope="session")
def small_base(build_env) -> str:
    """A few-MB image with a shell (busybox) for the build routes' tests."""
    return build_small_base(build_env)
