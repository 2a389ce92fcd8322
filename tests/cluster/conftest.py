"""Fixtures for the launcher tests: a real two-node Slurm on this host (see slurm_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from slurm_helpers import REPO, local_cluster, unavailable


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A two-node cluster (n1, n2 on this host) for the whole session; every daemon stopped by PID after."""
    try:
        c = local_cluster.up(tmp_path_factory.mktemp("slurm"), nodes=2)
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
    env = cluster.env()
    env.update(REPO_DIR=str(REPO), VENV=str(Path(sys.executable).parent.parent), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO / "src"))
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        env.pop(key)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env
