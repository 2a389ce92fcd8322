"""Fixtures for the launcher tests: a real two-node Slurm on this host (see slurm_helpers.py)."""

from __future__ import annotations

import pytest
from slurm_helpers import local_cluster, make_job_env, unavailable


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A three-node cluster (n1, n2, n3 on this host) for the whole session: the jobs take two nodes, the third lets
    a job leave a node behind; every daemon stopped by PID after."""
    try:
        c = local_cluster.up(tmp_path_factory.mktemp("slurm"), nodes=3)
    except local_cluster.ClusterUnavailable as e:
        unavailable(str(e))
    pids = dict(c.pids)
    yield c
    local_cluster.down(c)
    alive = {name: pid for name, pid in pids.items() if local_cluster.alive(pid)}
    assert not alive, f"daemons still running after tear-down: {alive}"


@pytest.fixture
def job_env(cluster):
    """Environment for sbatch/srun clients: cluster conf, repo code, quiet single-threaded torch."""
    return make_job_env(cluster)
