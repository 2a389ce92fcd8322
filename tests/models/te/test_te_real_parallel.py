"""TE context parallelism wired as training wires it, with real TE modules on CPU (make test-te): every TE
attention gets the CP group, its global ranks, a stream and the comm type; each rank feeds TE its head-tail
chunks and the RoPE angles of the whole sequence (TE's fused RoPE picks the rank's positions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformer_engine.pytorch  # noqa: F401

from helpers import cli_env
from llama_fp8.models.te.parallel import a2a_p2p_ranks

pytestmark = pytest.mark.te
WORKER = Path(__file__).with_name("te_cp_worker.py")


def run(tmp_path: Path, nproc: int, comm: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER),
           str(tmp_path), comm]
    r = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=300)
    said = [ln for ln in r.stderr.splitlines() if "Warning" not in ln and "sliced_mesh_layout" not in ln]
    assert r.returncode == 0, "\n".join(said)[:3000]  # the first lines: a rank's own error comes before torchrun's
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(nproc)]


@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a"])
def test_te_context_parallel_wiring_on_two_ranks(tmp_path, comm):
    ranks = run(tmp_path, 2, comm)
    for r, got in enumerate(ranks):
        assert (got["mode"], got["cp_size"], got["cp_rank"], got["ranks"], got["comm"]) == ("split", 2, r, [0, 1], comm)
        assert got["stream"] == "cp-stream" and got["group_ranks"] == [[0, 1]]
        assert (got["tokens"], got["rope_len"]) == (32, 64)  # half the tokens, the angles of all 64 positions
    assert ranks[0]["labels"] == list(range(0, 16)) + list(range(48, 64))  # chunks 0 and 3 of 4
    assert ranks[1]["labels"] == list(range(16, 48))  # chunks 1 and 2


def test_te_a2a_p2p_groups_on_four_ranks(tmp_path):
    assert a2a_p2p_ranks([0, 1, 2, 3]) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    ranks = run(tmp_path, 4, "a2a+p2p")
    for r, got in enumerate(ranks):
        pair, ring = [[0, 1], [2, 3]][r // 2], [[0, 2], [1, 3]][r % 2]
        assert got["group_ranks"] == [pair, ring]  # [a2a group, p2p group], as TE expects them
        assert got["cp_size"] == 4 and got["cp_rank"] == r  # TE's rank = a2a size x p2p rank + a2a rank
