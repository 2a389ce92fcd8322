"""The first visit of a GPU node, rehearsed on CPU with fake timings: its units in the issue's order, its
estimates adding up to about 25 minutes of node time (node starts and the install included) in three commands,
and three runs of the same command recording everything, each continuing where the last stopped."""

from __future__ import annotations

import pytest
import runs
import units
import verify
from test_gpu_verify import H100, KEY

FIRST = ["pytest/te-values"] + [f"train/llama3.2-1b/synthetic/{v}" for v in
                                ("hf-bf16", "hf-fp8-tensorwise", "te-bf16", "te-fp8-current")] + [
    "train/llama3.2-3b/synthetic/te-bf16", "train/llama3.2-3b/synthetic/te-fp8-current",
    "bench/te-current+torchao-tensorwise/llama3.2-3b"]


def test_the_first_plan_is_the_issues_order_and_fits_25_minutes_in_3_commands():
    plan = units.plan(units.Options(), "first")
    assert [u.id for u in plan] == FIRST
    assert plan[0].info["args"] == list(units.TE_VALUE_TESTS)
    assert all(u.estimate_s <= units.VISIT_COMMAND_S - units.INSTALL_S for u in plan)
    commands, seconds = units.first_visit_seconds()
    assert commands == 3 and seconds <= 26 * 60, (commands, seconds)
    assert units.Options().max_steps - units.Options().warmup == 30  # 30 timed steps after warm-up
    # a plan too big for three commands says so
    assert units.first_visit_seconds(plan + plan)[0] > 3


@pytest.mark.parametrize("slow,commands", [(1.0, 3), (1.3, 3), (1.7, 4)])
def test_three_runs_of_the_same_command_record_the_first_visit(tmp_path, monkeypatch, slow, commands):
    """Each fake unit takes its estimate times ``slow``: every command stops before a unit that would not fit
    and the next one continues there; up to 30 % over the estimates three commands record all, and a slower
    node needs a fourth run of the same command, which records the rest (nothing is run twice)."""
    monkeypatch.setattr(verify, "probe_versions", lambda args, work, env: dict(H100))
    clock, calls = [0.0], []
    real_budget = runs.Budget
    monkeypatch.setattr(verify.runs, "Budget", lambda s: real_budget(s, clock=lambda: clock[0]))

    def runner(ctx, unit):
        calls.append(unit.id)
        clock[0] += unit.estimate_s * slow
        return {"status": "passed"}

    for step in ("pytest", "train", "bench"):
        monkeypatch.setitem(verify.RUNNERS, step, runner)
    results = tmp_path / "r.jsonl"
    budget = units.VISIT_COMMAND_S - units.INSTALL_S
    argv = ["--plan", "first", "--budget-seconds", str(budget), "--results", str(results), "--work",
            str(tmp_path / "w"), "--mirror", str(tmp_path / "out")]
    codes = []
    for _ in range(5):
        codes.append(verify.main(argv))
        if codes[-1] == 0:
            break
    assert calls == FIRST  # in order, each once
    assert codes == [verify.EXIT_MORE] * (commands - 1) + [0]
    recorded = [r["unit"] for r in runs.load(results) if r.get("key") == KEY and r["unit"] != "versions"]
    assert recorded == FIRST


def test_a_command_on_another_driver_or_an_h200_goes_on_with_the_plan(tmp_path, monkeypatch):
    """The resume key is the GPU architecture and the library versions: a command that lands on another driver
    runs nothing twice; one that lands on an H200 does not repeat the tests either, only measures its own
    numbers (a number from an H100 is not an H200's). Every record names its GPU and driver."""
    import versions

    calls = []
    for step in ("pytest", "train", "bench"):
        monkeypatch.setitem(verify.RUNNERS, step, lambda ctx, unit: calls.append(unit.id) or {"status": "passed"})
    results = tmp_path / "r.jsonl"
    argv = ["--plan", "first", "--results", str(results), "--work", str(tmp_path / "w")]
    nodes = [dict(H100), {**H100, "driver": "575.57.08"}, {**H100, "gpu": "NVIDIA H200", "driver": "575.57.08"}]
    for node in nodes:
        node["key"] = versions.key(node)
    assert len({n["key"] for n in nodes}) == 1
    for node in nodes:
        monkeypatch.setattr(verify, "probe_versions", lambda args, work, env, node=node: dict(node))
        assert verify.main(argv) == 0
    assert calls == FIRST + FIRST[1:]  # the H200 measured its cells and benchmark, not the tests again
    records = [r for r in runs.load(results) if r["unit"] != "versions"]
    assert [(r["gpu"], r["driver"]) for r in records] == [(H100["gpu"], H100["driver"])] * len(FIRST) + [
        ("NVIDIA H200", "575.57.08")] * (len(FIRST) - 1)
