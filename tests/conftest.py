"""Fixtures shared by the tests in this folder (helpers live in helpers.py)."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import ports
from import_cache_env import use_import_cache

# Per-test wall, CPU, shared-fixture and training-run times when LLAMA_FP8_TEST_TIMES is set (tests/timing.py).
pytest_plugins = ("timing",)

# One OpenMP thread in the test processes, as every process they start already has (helpers.cli_env, the Slurm
# jobs' environment): `make test` runs three workers on two cores, and a worker's in-process runs of the tiny model
# gain nothing from a second intra-op thread but the CPU its waits spin away from the other workers (a run of the
# estimate, training and precision tests, two processes at once: 87 s instead of 91). Set before torch is imported
# (the first test module imports it); a value given by the caller is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# transformers' import table read from a file once scanned, not scanned again by each of the run's hundreds of
# processes that build a model (tests/startup/sitecustomize.py: 0.35 CPU s of a one-rank run's 2.6 s): the folder
# goes first on PYTHONPATH of this process's environment, which the xdist workers and every process the tests start
# inherit (helpers.cli_env and the Slurm jobs' environment keep it), and the run gets a cache folder of its own,
# removed at its end (tests/import_cache_env.py). Set here, before the workers start; a worker finds both set.
_IMPORT_CACHE_MADE = use_import_cache(os.environ)


def pytest_collection_finish(session):
    """Python's collector in a test process: what collection imported (torch, transformers, every test module) lives
    for the whole run, and each full collection walked it again; and the in-process training tests make millions of
    short-lived objects, a young collection every 700. Frozen once collected, out of every later walk, and young
    collections every 10,000 allocations: 10 % less CPU for a run of the in-process train, checkpoint, model,
    precision, report and estimate tests (45.5 -> 41 s user, back to back). Cyclic garbage still goes, a little
    later; the collector tests (test_collector.py) measure against the frozen count they find."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def _te_importable() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import torch  # noqa: F401  (first: TE finds libnccl through torch)
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


# The real-TE tier (marker te, `make test-te`) imports TE at module level: without TE those files are not
# collected at all, so `make test` neither imports them nor reports them as skipped; `make test-te` with
# a broken TE collects no test and fails (pytest exit code 5).
collect_ignore_glob = [] if _te_importable() else ["models/te/test_te_real_*.py"]


# Under pytest-xdist (`make test` runs three workers, --dist loadgroup) each worker is a session of its own: a
# session fixture used by two workers would be made twice. So every test is put in a group that one worker runs
# whole: the tests of the local Slurm cluster (its slurmd ports are fixed: one cluster per machine), those of the
# S3 server, the fault matrix's (its reference runs), and otherwise each file (its module fixtures made once).
# The groups go out longest first (the cluster's, then by their tests' expected time), so that the last ones given
# out are short and neither worker waits long for the other at the end; xdist's own order (by number of tests) gave
# out a file of five tests of a minute or more each after hundreds of quick ones. xdist's own xdist_group marks do
# not reach its scheduler under pytest 9 (the test ids it rewrites stay as they were), so the workers write each
# test's group to a file and the controller schedules by it (GroupScheduling).
SHARED_GROUPS = (("cluster", "slurm"), ("s3_server", "s3"), ("mlflow_server", "mlflow-server"),
                 ("ref2", "reliability"), ("ref1", "reliability"))  # the fault matrix's uninterrupted runs


def group_of(item) -> str:
    """The xdist group of a test: the first shared fixture it uses (directly or through another), else its file."""
    names = set(getattr(item, "fixturenames", ()))
    for fixture, group in SHARED_GROUPS:
        if fixture in names:
            return group
    return item.nodeid.split("::")[0]


# A test marked slow takes about 20 s on a 2-core machine, any other about 0.4 s (the means of a CI run's
# LLAMA_FP8_TEST_TIMES records): the weights that order the groups.
SLOW_WEIGHT = 50


def by_expected_time(items) -> None:
    """Sort ``items`` (in place, stable) so that the cluster's group comes first, then the other groups by their
    tests' expected time, the longest first."""
    groups = {item.nodeid: group_of(item) for item in items}
    weight: dict[str, int] = dict.fromkeys(groups.values(), 0)
    for item in items:
        weight[groups[item.nodeid]] += SLOW_WEIGHT if item.get_closest_marker("slow") else 1

    def key(item):
        group = groups[item.nodeid]
        return group != "slurm", -weight[group], group

    items.sort(key=key)


_GROUPS_FILE = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)  # xdist's hooks: a run without xdist (the image's self-test) has none
def pytest_configure_node(node):
    """Controller: tell each worker where to write the tests' groups (one file per test run)."""
    node.workerinput["llama_fp8_groups"] = str(_groups_file(node.config))


def _groups_file(config) -> Path:
    """The controller's file of the tests' groups: in a folder of its own, removed when the run ends."""
    if _GROUPS_FILE not in config.stash:
        config.stash[_GROUPS_FILE] = Path(tempfile.mkdtemp(prefix="llama-fp8-xdist-")) / "groups.json"
    return config.stash[_GROUPS_FILE]


def pytest_unconfigure(config):
    if _GROUPS_FILE in config.stash:
        shutil.rmtree(config.stash[_GROUPS_FILE].parent, ignore_errors=True)
    if _IMPORT_CACHE_MADE:
        shutil.rmtree(_IMPORT_CACHE_MADE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    where = getattr(config, "workerinput", {}).get("llama_fp8_groups")
    if not where:  # not an xdist worker: serial runs keep the files' order
        return
    by_expected_time(items)
    tmp = Path(f"{where}.{os.getpid()}")
    tmp.write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    tmp.replace(where)  # both workers write the same map; either is whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the groups go out in the workers' order (by_expected_time)

    class GroupScheduling(LoadScopeScheduling):
        """LoadScope's scheduling (a scope runs whole on one worker) with the groups the workers wrote as scopes."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once every worker has collected (the scheduler asks only then)
                self.groups = json.loads(_groups_file(config).read_text())
            return self.groups.get(nodeid, nodeid.split("::")[0])

    return GroupScheduling(config, log)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Tests that run training in this process let it set RANK, WORLD_SIZE, MASTER_ADDR... as a launcher would;
    put the environment back so that a later test (or the Slurm jobs it submits) does not inherit them."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_listener_left_on_a_job_port():
    """A test that leaves this process listening on a port that a Slurm job of the session's cluster will use fails
    here, naming it: the job's launcher could not open its rendezvous store (once: an in-process torchrun agent's
    store, which torch leaves open until its process ends)."""
    yield
    held = sorted(p for p in ports.listening_ports() if p in ports.JOB_PORTS)
    assert not held, f"this test left port(s) {held} listening in the test process, which Slurm jobs here use"


@pytest.fixture
def registry():
    """The model registry, with what a test registers removed again afterwards (the flag help lists it)."""
    from llama_fp8 import models

    saved = dict(models._REGISTRY)
    yield models
    models._REGISTRY.clear()
    models._REGISTRY.update(saved)


@pytest.fixture
def tiny_args(tmp_path) -> list[str]:
    """Flags for a fast single-process CPU run of a smaller-than-tiny model."""
    return ["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
            "--train_batch_size", "2", "--run_dir", str(tmp_path / "run")]


@pytest.fixture
def one_rank():
    """A one-process gloo world (what FSDP2 needs to shard on CPU); yields its DistEnv."""
    import torch
    import torch.distributed as dist

    from llama_fp8 import parallel

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield parallel.DistEnv(0, 0, 1, 1, torch.device("cpu"))
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (SeaweedFS) on 127.0.0.1 for the whole session, its keys in the environment as
    the AWS credential chain reads them (tests/s3kit.py); skipped naming what is missing (failed under CI=true)."""
    import s3kit

    s3kit.require()
    server = s3kit.S3Server(tmp_path_factory.mktemp("s3server"))
    server.start()
    keys = {"AWS_ACCESS_KEY_ID": s3kit.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": s3kit.SECRET_KEY}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
