"""Spare nodes (spares.py) with real torchrun agents: three launchers on localhost, two training (n1 hosts the
rendezvous, n2) and one spare (n3, LLAMA_FP8_SPARE=1, the same --nnodes=2), one stand-in worker each (standin.py).
A training node that is left behind hands its place to the spare, which joins the next round at the same world
size; no launcher ends the job. Each case takes seconds (a lost node: torch's 15 s heartbeat lapse)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from standin import attempts, finish, launch_nodes, outcome_fields

pytestmark = pytest.mark.slow  # three launchers and their workers: 45-70 s each on two cores

HEALTHY = {"exit": "wait", "step_s": 0.5}
WAIT_S = 900  # an upper bound, not a pace: three launchers start in ~25 s on an idle two-core machine, minutes on a busy one


def parent(tmp_path: Path, attempt: int, rank: int) -> int:
    """The launcher pid of the worker of ``rank`` in its ``attempt`` (started.<attempt>.<rank>: pid ppid)."""
    return int((tmp_path / f"started.{attempt}.{rank}").read_text().split()[1])


def test_a_node_failing_twice_without_progress_hands_its_place_to_the_spare(tmp_path):
    """n2 kills its rank twice with the same latest checkpoint (step 2): it is left behind, and the spare n3 takes its
    place at the next rendezvous: the job finishes on n1 and n3, no launcher asks for a requeue. n2's launcher ends
    with ``left`` (its exclusion for the batch script), the spare's worker runs the last attempt."""
    plan = {"0": {"1": {"exit": "kill", "ckpt": 2, "step": 3}, "0": HEALTHY},
            "1": {"1": {"exit": "kill", "ckpt": 2, "step": 4, "after": 1}, "0": HEALTHY}, "2": {}}
    procs = launch_nodes(tmp_path, plan, names=True, spares=1, LLAMA_FP8_SPARE_JOIN_S="60")
    codes, err = finish(tmp_path, procs, timeout=WAIT_S)
    assert codes == [0, 0, 0], err[-5000:]
    left, spare, host = (outcome_fields(tmp_path, f"node{n}") for n in (1, 2, 0))
    assert (left["action"], left["exclude"]) == ("left", ["n2"]), left
    assert "this node has failed 2 times without a new checkpoint (the latest complete: step 2)" in left["line"], left
    assert "left behind: spare n3 takes its place at the next rendezvous (no requeue)" in left["line"], left
    assert (spare["action"], host["action"]) == ("done", "done"), (spare, host)
    assert "node n3: a spare, takes the place of n2" in err, err[-5000:]
    assert attempts(tmp_path, 0) == 3 and attempts(tmp_path, 1) == 3, err[-5000:]
    workers = {parent(tmp_path, 2, r) for r in (0, 1)}
    assert workers == {procs[0].pid, procs[2].pid}, (workers, [p.pid for p in procs])


def test_a_lost_node_is_replaced_by_the_spare_after_its_heartbeats_lapse(tmp_path):
    """n2's launcher and its worker SIGKILLed (a node that stops answering): torch drops it after its heartbeats
    lapse (15 s), the restarted round stays a node short, and the spare takes the place (LLAMA_FP8_SPARE_JOIN_S=2).
    The other node's rank fails when its peer is gone (as a collective would). The workers of the next attempt
    learn the swap (LLAMA_FP8_SWAPS), for training's records."""
    plan = {"0": {"0": {"exit": 1, "peer_gone": 1}, "1": {"exit": 1, "peer_gone": 0}}, "1": {}}
    procs = launch_nodes(tmp_path, plan, names=True, spares=1, LLAMA_FP8_SPARE_JOIN_S="2")
    deadline = time.monotonic() + WAIT_S
    while len(list(tmp_path.glob("started.0.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    lost = next(r for r in (0, 1) if parent(tmp_path, 0, r) == procs[1].pid)
    os.kill(procs[1].pid, signal.SIGKILL)
    killed = time.time()
    os.kill(int((tmp_path / f"started.0.{lost}").read_text().split()[0]), signal.SIGKILL)
    codes, err = finish(tmp_path, procs, timeout=WAIT_S)
    assert codes[0] == 0 and codes[2] == 0, err[-5000:]
    assert outcome_fields(tmp_path, "node2")["action"] == "done", err[-5000:]
    assert "node n3: a spare, takes a place (a node stopped answering: round" in err, err[-5000:]
    assert {parent(tmp_path, 1, r) for r in (0, 1)} == {procs[0].pid, procs[2].pid}
    swaps = json.loads((tmp_path / "swaps.1").read_text()) if (tmp_path / "swaps.1").exists() else None
    assert swaps and swaps[0]["in"] == "n3" and swaps[0]["failed_at"] >= killed - 1, swaps


def test_a_node_failing_its_health_check_goes_to_the_spare_and_an_unused_spare_says_so(tmp_path):
    """n2's rank is killed once, then n2 fails its health check before the restart (LLAMA_FP8_NODE_CHECK): it leaves
    its place to the spare n3 (before: the step ended and the job was requeued without it). Then a job where nothing
    fails: the spare ends with ``spare`` when the rendezvous closes, never having joined."""
    plan = {"0": {"1": {"exit": "kill", "step": 3}, "0": HEALTHY}, "1": {}}
    check = 'test "$SLURMD_NODENAME" != n2 || { echo "GPU 3: not found" >&2; exit 3; }'
    codes, err = finish(tmp_path, launch_nodes(tmp_path, plan, names=True, spares=1, LLAMA_FP8_NODE_CHECK=check),
                        timeout=WAIT_S)
    assert codes == [0, 0, 0], err[-5000:]
    left = outcome_fields(tmp_path, "node1")
    assert left["action"] == "left" and "GPU 3: not found: failed its health check before a restart" in left["line"]
    assert outcome_fields(tmp_path, "node2")["action"] == "done"
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    codes, err = finish(quiet, launch_nodes(quiet, {"0": {}}, names=True, spares=1), timeout=WAIT_S)
    assert codes == [0, 0, 0], err[-5000:]
    unused = outcome_fields(quiet, "node2")
    # the rendezvous closed while it waited, or its store went away with the first node's launcher at the job's end
    # (which of the two depends on timing; before, the second ended the spare with 86: "lost the rendezvous store")
    assert (unused["code"], unused["action"]) == (0, "spare") and "a spare, not " in unused["line"], unused
    assert attempts(quiet, 0) == 1 and attempts(quiet, 1) == 1
