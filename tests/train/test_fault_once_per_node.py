"""A node-bound ``once`` fault (faults/inject.py) fires once for its node, whichever rank the node has: ranks move
between nodes when a training step starts again (a restart in place, a spare that joined), and a fault meant for
"the second failure of this node" must not fire again for the rank the node has next."""

from __future__ import annotations

from llama_fp8 import faults


def test_a_node_bound_once_fault_fires_once_per_node_whatever_its_rank(tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr(faults.inject, "_fire", lambda f, rank, step, folder: fired.append((rank, step)))
    monkeypatch.setenv("LLAMA_FP8_FAULT", "kill@step:node=n2:step=6:once")
    monkeypatch.setenv("LLAMA_FP8_FAULT_DIR", str(tmp_path))
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    monkeypatch.setattr(faults.inject, "_rank", lambda: 1)
    faults.at("step", 6)
    monkeypatch.setattr(faults.inject, "_rank", lambda: 0)  # the next launch: n2 has rank 0 now
    faults.at("step", 6)
    assert fired == [(1, 6)]
    assert (tmp_path / "fired.step.rank1.step6").exists() and (tmp_path / "fired.step.node-n2.step6").exists()
    monkeypatch.setenv("LLAMA_FP8_FAULT", "kill@step:step=6:once")  # without node=: once per rank, as before
    faults.at("step", 6)
    assert fired == [(1, 6), (0, 6)]
