"""The order in which `make test` hands the test groups to its workers (tests/conftest.py): the cluster's group
first, then the other groups by their tests' expected time, so that the groups given out last are short."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent


def root_conftest():
    """tests/conftest.py itself (a plain `import conftest` may find a subfolder's)."""
    spec = importlib.util.spec_from_file_location("llama_fp8_tests_root_conftest", HERE / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def item(nodeid: str, slow: bool = False, fixtures: tuple[str, ...] = ()) -> SimpleNamespace:
    marker = SimpleNamespace(name="slow") if slow else None
    return SimpleNamespace(nodeid=nodeid, fixturenames=list(fixtures),
                           get_closest_marker=lambda name: marker if name == "slow" else None)


def test_groups_go_out_cluster_first_then_longest_expected_first_each_kept_whole():
    conftest = root_conftest()
    quick = [item(f"tests/test_many.py::test_{i}") for i in range(40)]  # 40 x 1
    long = [item("tests/test_few.py::test_a", slow=True), item("tests/test_few.py::test_b", slow=True)]  # 2 x 50
    shared = [item("tests/reliability/test_x.py::test_1", fixtures=("ref1",)),
              item("tests/reliability/test_y.py::test_2", slow=True, fixtures=("ref2",))]  # one group: 51
    cluster = [item("tests/cluster/test_z.py::test_job", fixtures=("cluster",))]  # 1, but the cluster's: first
    items = [*quick, shared[0], *long, shared[1], *cluster]
    conftest.by_expected_time(items)
    assert [conftest.group_of(i) for i in items] == (
        ["slurm"] + ["tests/test_few.py"] * 2 + ["reliability"] * 2 + ["tests/test_many.py"] * 40)
    assert [i.nodeid for i in items[5:]] == [i.nodeid for i in quick]  # each group's own order is kept
    assert [i.nodeid for i in items[3:5]] == [i.nodeid for i in shared]


class Worker:
    """A stand-in for xdist's WorkerController: records the tests (indexes into its collection) it is sent."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[list[int]] = []
        self.shutting_down = False

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent.append(indexes)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_the_scheduler_hands_out_the_groups_in_the_workers_order_not_by_their_number_of_tests():
    """xdist's LoadScope reorders the groups by number of tests unless told not to (it gave a file of five long
    tests after hundreds of quick ones): the scheduler made for --dist loadgroup keeps the order the workers
    collected (by_expected_time's), each group whole on one worker."""
    conftest = root_conftest()
    collection = ["tests/test_few.py::test_a", "tests/test_few.py::test_b",
                  *(f"tests/test_many.py::test_{i}" for i in range(6)), "tests/test_one.py::test_c"]
    config = SimpleNamespace(stash=pytest.Stash(), option=SimpleNamespace(dist="loadgroup", loadscopereorder=True,
                                                                           tx=["2*popen"]))
    config.getvalue = lambda name: getattr(config.option, name)
    try:
        conftest._groups_file(config).write_text(json.dumps({n: n.split("::")[0] for n in collection}))
        scheduler = conftest.pytest_xdist_make_scheduler(config, None)
        workers = [Worker("gw0"), Worker("gw1")]
        for w in workers:
            scheduler.add_node(w)
        for w in workers:
            scheduler.add_node_collection(w, collection)
        scheduler.schedule()
    finally:
        conftest.pytest_unconfigure(config)
    # The first group (two tests) to the first worker, the second (six) to the other; the first, with no more than
    # two tests pending, gets the third at once. Reordered by number of tests, the six would have gone first.
    assert [w.sent for w in workers] == [[[0, 1], [8]], [[2, 3, 4, 5, 6, 7]]]
    assert config.option.loadscopereorder is False
