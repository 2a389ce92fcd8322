"""A spare node swapped in (telemetry/swaps.py): what training records about it, from what the launcher passed on
(LLAMA_FP8_SWAPS), and what the A/B report shows: the swap in the goodput section, and the run named as one that
ran on other hardware."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llama_fp8.report import compare as C
from llama_fp8.telemetry import environment, swaps


def test_pending_swaps_are_read_bounded_and_checked():
    good = {"in": "n3", "out": "n2", "why": "node 1 (n2): failed 2 times", "failed_at": 100.5, "ticket": 1}
    env = {swaps.ENV: json.dumps([good, {"in": "n4"}, {"in": "", "failed_at": 1.0}, "x",
                                  {"in": "n5", "failed_at": float("nan")}])}
    assert swaps.pending(env) == [{"node_in": "n3", "node_out": "n2", "why": "node 1 (n2): failed 2 times",
                                   "failed_at": 100.5}]
    assert swaps.pending({swaps.ENV: "not json"}) == [] and swaps.pending({}) == []
    assert swaps.pending({swaps.ENV: json.dumps([good]) + " " * swaps.MAX_BYTES}) == []
    long = swaps.pending({swaps.ENV: json.dumps([{**good, "why": "y" * 5000}])})[0]
    assert len(long["why"]) == swaps.TEXT


@pytest.mark.parametrize("kind,cluster,cost", [("hyperpod", "hyperpod", "cost 20-30 min"),
                                               ("parallelcluster", "parallelcluster", "cost 2-30 min"),
                                               ("slurm", "slurm", "cost at least"), ("lsf", "slurm", "cost at least")])
def test_the_record_gives_the_failure_to_step_time_and_the_requeue_it_saved(kind, cluster, cost):
    (swap,) = swaps.pending({swaps.ENV: json.dumps([{"in": "n3", "out": "n2", "why": "lost", "failed_at": 1000.0}])})
    rec = swaps.record(swap, 7, now=1012.5, env={swaps.CLUSTER_ENV: kind})
    assert rec["type"] == "swap" and rec["step"] == 7 and rec["failure_to_step_s"] == 12.5
    assert rec["cluster"] == cluster and rec["requeue_expected_s"] == list(swaps.REQUEUE[cluster][:2])
    text = swaps.line(rec)
    assert text.startswith("swap: spare n3 took the place of n2 (lost); failure -> step 7 in 12.5 s, no requeue; "
                           f"a requeue would have {cost}"), text


def test_the_environment_names_the_attempts_training_nodes():
    base = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3"}
    assert environment.describe("cpu", base)["nodes"] == "n[1-3]"
    got = environment.describe("cpu", {**base, "LLAMA_FP8_NODES": "n1,n3"})
    assert (got["nodes"], got["num_nodes"]) == ("n1,n3", 2)


def _run(run_dir: Path, precision: str, nodes: list[str], swap: dict | None = None) -> None:
    run_dir.mkdir(parents=True)
    recs = []
    for i, n in enumerate(nodes):
        recs.append({"type": "meta", "precision": precision, "world_size": 2, "environment": {"nodes": n}})
        for step in range(1 + 10 * i, 21 + 10 * i):
            recs.append({"type": "train", "step": step, "loss": 5.0 - step / 100, "samples_per_sec": 50.0,
                         "tokens_per_sec_per_device": 800.0, "precision": precision, "world_size": 2,
                         "time": 1000.0 + step})
    if swap:
        recs.append(swap)
    recs.append({"type": "goodput", "step": 30, "wall_s": 40.0, "productive_s": 30.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_the_report_lists_each_swap_and_names_the_run_that_ran_on_other_hardware(tmp_path):
    """The FP8 arm had a spare node take n2's place during the run (its second attempt on n1,n3): the report's
    hardware section says it ran on other hardware, and its goodput section shows the swap and its timings."""
    (swap,) = swaps.pending({swaps.ENV: json.dumps([{"in": "n3", "out": "n2", "why": "n2 failed twice",
                                                    "failed_at": 1010.0}])})
    rec = swaps.record(swap, 11, now=1031.0, env={swaps.CLUSTER_ENV: "hyperpod"})
    _run(tmp_path / "bf16", "bf16", ["n1,n2"])
    _run(tmp_path / "fp8", "fp8", ["n1,n2", "n1,n3"], rec)
    assert C.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "o")]) == 0
    report = (tmp_path / "o" / "report.md").read_text()
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["environment"]["other_hardware"] == [
        "fp8 (B, pair 1): nodes n1,n2 then n1,n3 (spare n3 took the place of n2 before step 11)"]
    assert "Runs on other hardware than bf16 (A, pair 1)" in report and "**not the same hardware**" in report
    assert "| swaps to a spare node (no requeue) | none | 1: failure to next step median 21.0 s, max 21.0 s |" \
        in report, report
    assert "run fp8: swap: spare n3 took the place of n2 (n2 failed twice); failure -> step 11 in 21.0 s, no " \
        "requeue; a requeue would have cost 20-30 min (hyperpod:" in report
