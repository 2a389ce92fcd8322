"""`llama-fp8 launch` on two "nodes": two launchers on localhost sharing a c10d rendezvous that the first hosts,
one stand-in worker each (standin.py), as 1.train_llama.sbatch runs them on two Slurm nodes. What only shows
with more than one agent: the job-wide restart budget, a node that finished while another failed, a lost
rendezvous host."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
from standin import attempts, finish, launch_nodes, outcome


@pytest.mark.slow
def test_the_restart_budget_is_the_jobs_across_nodes(tmp_path):
    """--max_restarts 2 and failures on alternating nodes (rank 0's, rank 1's, rank 0's): torch would allow 2
    restarts per node and start a fourth attempt; the job gets 2 in all and stops at the third failure. (A node
    that stops ends the rendezvous for the other: exit 86 there when it was the host, which lf_outcome ranks
    below the failure.)"""
    healthy = {"exit": "wait", "step_s": 0.5}
    plan = {"0": {"0": {"exit": 1, "step": 1}, "1": healthy},
            "1": {"1": {"exit": 1, "step": 2}, "0": healthy},
            "2": {"0": {"exit": 1, "step": 3}, "1": {"exit": 1, "step": 3, "after": 2}}}
    codes, err = finish(tmp_path, launch_nodes(tmp_path, plan, max_restarts=2))
    assert attempts(tmp_path, 0) == 3 and attempts(tmp_path, 1) == 3, err[-4000:]
    assert "closing signal SIGTERM" not in err, err[-4000:]  # the healthy node's workers: SIGKILL only
    assert 1 in codes and set(codes) <= {1, 86}, err[-4000:]
    assert "the job's 2 restart(s) without a new checkpoint are used up" in err, err[-4000:]


@pytest.mark.slow
def test_a_failure_after_training_finished_ends_the_job_as_done(tmp_path):
    """Both ranks finished (the final checkpoint is complete, their progress says so); one exits 0, the other
    segfaults 3 s later in its teardown. Before: the finished node waited 300 s in torch's exit barrier while the
    other sought a new rendezvous round, then "closed" it: a failed job after 5 minutes. Now both end at once,
    done."""
    plan = {"0": {"0": {"phase": "finished", "step": 8}, "1": {"phase": "finished", "step": 8, "exit": "segv",
                                                               "after": 3}}}
    t0 = time.monotonic()
    codes, err = finish(tmp_path, launch_nodes(tmp_path, plan), timeout=90)
    assert codes == [0, 0], f"{codes} after {time.monotonic() - t0:.0f} s\n{err[-4000:]}"
    assert attempts(tmp_path, 0) == 1 and attempts(tmp_path, 1) == 1
    assert "rank 1 (killed by SIGSEGV) after training finished" in err, err[-4000:]
    for node in ("node0", "node1"):
        assert outcome(tmp_path, node)[:2] == (0, "done"), outcome(tmp_path, node)


@pytest.mark.slow
def test_a_lost_rendezvous_host_kills_the_other_nodes_workers_at_once(tmp_path):
    """The first node's launcher (the rendezvous host) and its worker SIGKILLed: the other launcher cannot go on
    (exit 86, requeue). Its worker gets SIGKILL, not torch's SIGTERM + 30 s, which our workers read as "save a
    checkpoint" (a save that cannot complete without the lost ranks)."""
    worker = {"exit": "wait", "step_s": 0.5, "on_term": True}
    procs = launch_nodes(tmp_path, {"0": {"0": worker, "1": worker}})
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started.0.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    started = {int(f.name.split(".")[2]): tuple(map(int, f.read_text().split())) for f in tmp_path.glob("started.0.*")}
    assert len(started) == 2, finish(tmp_path, procs, timeout=1)[1]
    (host_rank,) = [r for r, (_, parent) in started.items() if parent == procs[0].pid]
    os.kill(procs[0].pid, signal.SIGKILL)
    os.kill(started[host_rank][0], signal.SIGKILL)  # its node is gone with it
    codes, err = finish(tmp_path, procs, timeout=60)
    assert codes[1] == 86, err[-4000:]
    assert outcome(tmp_path, "node1")[:2] == (86, "retry")
    other = 1 - host_rank
    assert not (tmp_path / f"sigterm.0.{other}").exists(), "the other node's worker got SIGTERM"
    assert not os.path.exists(f"/proc/{started[other][0]}"), "the other node's worker outlived its launcher"


@pytest.mark.slow
def test_a_stop_signal_requeues_every_node_though_the_host_ends_first(tmp_path):
    """SIGUSR1 (a time limit) to both launchers: the first node's worker saves at once and its launcher, the
    rendezvous host, ends; the other node's worker takes 4 s more to save. Its launcher must not look for the store
    meanwhile: before, it lost the store while waiting for its worker and reported a lost host (exit 86, "retry"),
    where both nodes saved their checkpoint (seen under Pyxis on the local cluster)."""
    worker = {"exit": "wait", "step_s": 0.5, "on_usr1": 85, "usr1_s": {"1": 4}}
    procs = launch_nodes(tmp_path, {"0": {"0": worker, "1": worker}})
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started.0.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(list(tmp_path.glob("started.0.*"))) == 2, finish(tmp_path, procs, timeout=1)[1]
    for p in procs:
        p.send_signal(signal.SIGUSR1)
    codes, err = finish(tmp_path, procs, timeout=60)
    assert codes == [85, 85], err[-4000:]
    for node in ("node0", "node1"):
        code, action, line = outcome(tmp_path, node)
        assert (code, action) == (85, "requeue") and "after SIGUSR1" in line, (node, line)


def test_a_busy_rendezvous_port_is_named_not_called_a_lost_host(tmp_path):
    """The first node's launcher cannot open the rendezvous store (another process holds the port): the line says
    so and names RDZV_PORT, not "the host is gone" (this node is the host). Requeued (bounded by MAX_REQUEUES): the
    holder may be a process of the job's previous run on its way out."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        codes, err = finish(tmp_path, launch_nodes(tmp_path, {}, nodes=1, port=port), timeout=90)
    assert codes == [86], err[-3000:]
    code, action, line = outcome(tmp_path, "node0")
    assert (code, action) == (86, "retry") and f"127.0.0.1:{port}" in line and "RDZV_PORT" in line, line
    assert "could not open the rendezvous store" in line and "host" not in line.split("(")[0], line


@pytest.mark.slow
def test_a_node_missing_from_the_rendezvous_is_named_not_called_a_lost_host(tmp_path):
    """Only one of two launchers ever joins (a node whose launcher did not start): after join_timeout the line
    says that a node is missing, not that the host is gone (this launcher is the host)."""
    codes, err = finish(tmp_path, launch_nodes(tmp_path, {}, conf="join_timeout=3,", started=1), timeout=90)
    assert codes == [86], err[-3000:]
    code, action, line = outcome(tmp_path, "node0")
    assert action == "retry" and "did not join within 3 s" in line and "gone" not in line, line
