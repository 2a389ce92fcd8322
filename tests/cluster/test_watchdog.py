"""The launcher's hang bounds and its naming of the rank the others wait for (cluster/launch/watchdog.py), on
records shaped as the workers write them (telemetry/heartbeat.py). The launcher itself, with stand-in and real
workers: test_hangs.py."""

from __future__ import annotations

import pytest

from llama_fp8.cluster.launch import watchdog
from llama_fp8.cluster.launch.watchdog import Bounds, Memory

B = Bounds()


def rec(phase="step", step=5, time=1000.0, step_max_s=None, took=None, expect=None):
    return {"rank": 0, "step": step, "phase": phase, "time": time, "step_max_s": step_max_s, "took": took or {},
            "expect": expect or {}}


def test_the_default_bounds_and_their_overrides():
    assert (B.factor, B.floor_s, B.unmeasured_s) == (5.0, 15.0, 1800.0)
    got = Bounds.from_env({watchdog.FACTOR_ENV: "3", watchdog.FLOOR_ENV: "2.5", watchdog.UNMEASURED_ENV: "60"})
    assert (got.factor, got.floor_s, got.unmeasured_s, got.on) == (3.0, 2.5, 60.0, True)
    assert not Bounds.from_env({watchdog.FACTOR_ENV: "0"}).on  # off
    for var, bad in ((watchdog.FACTOR_ENV, "-1"), (watchdog.FLOOR_ENV, "0"), (watchdog.UNMEASURED_ENV, "ten"),
                     (watchdog.FLOOR_ENV, "inf")):
        with pytest.raises(ValueError, match=var):
            Bounds.from_env({var: bad})


def test_a_steps_bound_is_a_factor_of_its_recent_steps_with_a_floor():
    assert watchdog.bound(rec(step_max_s=0.2), B, Memory())[0] == 15.0  # a tiny model: the floor
    assert watchdog.bound(rec(step_max_s=20.0), B, Memory())[0] == 100.0  # a 20 s GPU step: 5 x
    limit, why = watchdog.bound(rec(step_max_s=None), B, Memory())  # an attempt's first step: compile, warm-up
    assert limit == 1800.0 and "no first step measured" in why
    mem = Memory()
    mem.learn({"took": {"first_step": 40.0}})  # an earlier attempt's first step
    assert watchdog.bound(rec(step_max_s=None), B, mem)[0] == 200.0


def test_evaluation_save_and_startup_are_bounded_by_what_the_job_measured():
    mem = Memory()
    assert watchdog.bound(rec("save"), B, mem)[0] == 1800.0  # never measured: stated
    assert watchdog.bound(rec("save", expect={"save": 30.0}), B, mem)[0] == 150.0  # the checkpoint's recorded time
    assert watchdog.bound(rec("save", took={"save": 2.0}), B, mem)[0] == 15.0  # this attempt's save: 5 x, floor
    mem.learn({"took": {"eval": 12.0, "startup": 8.0}, "step_max_s": 0.3})
    assert watchdog.bound(rec("eval"), B, mem)[0] == 60.0
    assert watchdog.bound(rec("startup"), B, mem)[0] == 40.0
    assert watchdog.bound(rec("data"), B, mem)[0] == 1800.0  # a loader waiting on the network: not a hang
    assert watchdog.bound(rec("finished"), B, mem)[0] is None


def test_stalls_are_ranks_past_their_bound_and_start_up_counts_from_the_attempt():
    recs = {0: rec(time=1000.0, step_max_s=0.2), 1: rec(time=990.0, step_max_s=0.2),
            2: rec("startup", time=900.0), 3: rec("finished", time=0.0)}
    assert watchdog.stalls(recs, now=1004.0, bounds=B, memory=Memory(), started=995.0) == []  # rank 1: 14 s
    got = watchdog.stalls(recs, now=1010.5, bounds=B, memory=Memory(), started=995.0)
    assert [s.rank for s in got] == [1] and got[0].where() == "in step 5" and got[0].bound_s == 15.0
    assert watchdog.stalls(recs, now=5000.0, bounds=Bounds(factor=0), memory=Memory()) == []  # off


def ranks(**seqs):
    """rank -> summary with the given sequence numbers per group, e.g. r0={"w": 5}."""
    return {int(k[1:]): {"seq": v, "state": "S", "host": f"n{int(k[1:]) // 2}", "pid": 100 + int(k[1:])}
            for k, v in seqs.items()}


def test_the_rank_behind_in_its_group_is_the_one_the_others_wait_for():
    got = ranks(r0={"w": 41}, r1={"w": 40}, r2={"w": 41}, r3={"w": 41})  # rank 1 never issued the 41st
    assert watchdog.culprits(got) == ([1], "behind")
    assert watchdog.lag(got)[0] == {1: 1}


def test_a_victim_lagging_in_another_group_of_a_2d_mesh_is_not_named():
    """Ranks 0-3 on a 2x2 mesh, TP groups {0,1} {2,3}, DP groups {0,2} {1,3}. Rank 1 hangs: rank 0 waits for it in
    their TP collective, so never issues its next DP one; rank 2 waits for rank 0 there, rank 3 for rank 1. Rank 0
    is behind rank 2 in DP {0,2}, but ahead of rank 1 in TP {0,1}: it waits, it is a victim."""
    got = ranks(r0={"tp01": 11, "dp02": 7}, r1={"tp01": 10, "dp13": 7}, r2={"tp23": 11, "dp02": 8},
                r3={"tp23": 11, "dp13": 8})
    assert watchdog.culprits(got) == ([1], "behind")


def test_a_stopped_process_first_then_the_rank_behind_then_the_flight_recorder_then_nobody():
    level = ranks(r0={"w": 9}, r1={"w": 9})
    level[1]["state"] = "T"
    assert watchdog.culprits(level) == ([1], "stopped")
    frozen = ranks(r0={"w": 9}, r1={"w": 16})  # both stopped: rank 0's count froze a tick earlier, compare nothing
    frozen[0]["state"] = frozen[1]["state"] = "T"
    assert watchdog.culprits(frozen) == ([], "all")
    level[1]["state"] = "S"
    assert watchdog.culprits(level) == ([], "all")
    level[0]["fr"] = {"0": [9, "started"]}  # rank 0's collective 9 is running on its GPU, waiting ...
    level[1]["fr"] = {"0": [9, "scheduled"]}  # ... for rank 1, whose GPU never started it
    assert watchdog.culprits(level) == ([1], "flight recorder")
    for s in level.values():
        s.pop("fr")
    assert watchdog.culprits(level, stalled={0}) == ([0], "stalled")  # the only rank past its bound
    assert watchdog.culprits(level, stalled={0, 1}) == ([], "all")


def test_the_line_names_the_rank_its_node_and_the_bound():
    stall = watchdog.Stall(1, "step", 5, 16.2, 15.0, "5 x its recent step time (0.20 s), at least 15 s")
    line = watchdog.describe(1, {"host": "n2", "pid": 77, "state": "T", "phase": "step", "step": 5}, 1, stall)
    assert line == ("rank 1 (n2, pid 77): stopped (SIGSTOP) in step 5, 1 collective(s) behind the others, no progress "
                    "for 16 s (bound 15 s: 5 x its recent step time (0.20 s), at least 15 s)")


def test_a_stopped_rank_named_before_its_own_bound_passed_is_told_with_its_time_without_progress(tmp_path):
    """The rank waiting for a stopped one can pass its bound first (its record is the older by up to a tick); the
    stopped rank is then named (by its state) before its own bound passed, and its line still tells how long it has
    gone without progress and its bound. Before, that part was left out, as CI saw it once."""
    import signal
    import subprocess
    import time

    from llama_fp8.cluster.launch import hangs, peers

    procs = {r: subprocess.Popen(["sleep", "60"]) for r in (0, 1)}
    try:
        procs[1].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while open(f"/proc/{procs[1].pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        now = time.time()
        recs = {0: {**rec(time=now - 4.0, step_max_s=0.5), "rank": 0},  # past its bound of 2.5 s
                1: {**rec(time=now - 1.0, step_max_s=0.5), "rank": 1}}  # stopped 1 s ago: not yet

        class Agent:
            progress_dir = tmp_path
            _worker_group = None

            def progress(self):
                return recs

            def ranked_procs(self):
                return procs

            def kill_running(self):
                self.killed = True

        agent = Agent()
        watch = hangs.HangWatch(agent, Bounds(floor_s=2.0))
        watch.look()
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    line = watch.hang.line
    assert agent.killed and watch.hang.charged == peers.node_name()
    assert "a hang: rank 1 (" in line and "stopped (SIGSTOP) in step 5, no progress for 1 s (bound 2 s: 5 x its " \
        "recent step time (0.50 s), at least 2 s); rank(s) 0 wait for it (named: stopped)" in line, line
