"""The first visit of a GPU node, on CPU with fake timings: its units ordered by value (the headline first), its
clock at the worst case (the node's start, every command killed at its limit, the transfers both ways, the gap and
the hand-back: at most 780 of the visit's 900 s; the second command only with 240 s left, and then it cannot run
out), and the commands recording everything, each continuing where the last stopped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import runs
import units
import verify
from test_gpu_verify import H100, KEY

HEADLINE = ["train/llama3.2-1b/synthetic/te-bf16", "train/llama3.2-1b/synthetic/te-fp8-current",
            "train/llama3.2-1b/synthetic/te-fp8-current/pair2", "train/llama3.2-1b/synthetic/te-bf16/pair2"]
FIRST = HEADLINE + ["memory/terms", "estimate/llama3.2-1b/synthetic/te-fp8-current", "pytest/te-logits",
                    "estimate/llama3.2-1b/synthetic/te-bf16", "train/llama3.2-1b/synthetic/hf-bf16"]
VISIT = Path(__file__).resolve().parents[3] / "scripts" / "gpu" / "visit.sh"


def test_the_first_plan_is_ordered_by_value():
    """The headline's interleaved pairs (bf16 fp8, fp8 bf16; one seed per pair), the memory terms and the estimate
    of the FP8 configuration, the TE vs HF logits, then the BF16 estimate and HF BF16; plan all goes on from there."""
    plan = units.plan(units.Options(), "first")
    assert [u.id for u in plan] == FIRST
    assert [(u.info["variant"], u.info["pair"], u.info["seed"]) for u in plan[:4]] == [
        ("te-bf16", 1, 1234), ("te-fp8-current", 1, 1234), ("te-fp8-current", 2, 1235), ("te-bf16", 2, 1235)]
    assert {u.info["impl"] for u in plan[:4]} == {"te"} and not any(u.info["compile"] for u in plan[:4])
    assert plan[5].info["cell"] == HEADLINE[1] and plan[7].info["cell"] == HEADLINE[0]
    assert plan[6].info["args"] == list(units.TE_LOGITS_TESTS)
    everything = units.plan(units.Options())
    assert [u.id for u in everything[:len(FIRST) + 3]] == FIRST + [
        "pytest/te-resume", "train/llama3.2-1b/synthetic/hf-bf16-compile", "train/llama3.2-1b/synthetic/hf-fp8-tensorwise"]
    assert len({u.id for u in everything}) == len(everything)


def test_the_visit_at_its_worst_fits_780_of_its_900_seconds():
    """The budget check: every command killed at its hard limit, the transfers in and out counted, the gap before
    the second command and the hand-back; the first command holds the headline; the second is sent only with
    SECOND_MIN_LEFT_S left, which the first at its worst leaves, and then it cannot run the visit out."""
    visit = units.first_visit()
    assert len(visit.commands) == len(units.COMMANDS) == 2
    assert visit.worst_s() == units.NODE_START_S + sum(units.TRANSFER_IN_S + c.limit_s + units.TRANSFER_OUT_S
                                                       for c in units.COMMANDS) + units.GAP_S + units.RELEASE_S
    assert visit.worst_s() <= units.VISIT_WORST_S == 780 < units.VISIT_S == 900
    assert units.TRANSFER_IN_S > 0 and units.TRANSFER_OUT_S > 0 and units.NODE_START_S >= 60  # counted, not left out
    assert visit.left_before_second_s() >= units.SECOND_MIN_LEFT_S == 240
    second = units.GAP_S + units.COMMANDS[1].worst_s() + units.RELEASE_S
    assert second <= units.SECOND_MIN_LEFT_S  # sent with 240 s left, it ends inside the visit whatever happens
    assert all(c.limit_s <= 600 for c in units.COMMANDS)  # a node's limit for one command
    assert [u.id for u in visit.commands[0][:4]] == HEADLINE
    for c, packed in zip(units.COMMANDS, visit.commands):  # by the estimates, each command's units fit its budget
        assert c.install_s + units.MARGIN_S + sum(u.estimate_s for u in packed) <= c.budget_s < c.limit_s
    assert units.COMMANDS[0].install_s >= units.INSTALL_S and units.COMMANDS[1].install_s >= units.REUSE_S
    # the check can fail: a first command 30 s longer breaks it
    longer = units.Command(units.COMMANDS[0].limit_s + 30, units.INSTALL_S)
    assert units.NODE_START_S + longer.worst_s() + units.GAP_S + units.COMMANDS[1].worst_s() + units.RELEASE_S > 780
    assert any(line.startswith("visit at worst: 780 s") for line in visit.lines())


def test_visit_sh_defaults_to_the_plans_first_command_and_its_margin():
    text = VISIT.read_text()
    assert f"budget=${{VISIT_SECONDS:-{units.COMMANDS[0].budget_s}}}" in text
    assert re.search(rf"^margin={units.MARGIN_S}\b", text, re.M)
    [install] = [x for x in text.splitlines() if 'install.py" "$wheels"' in x]
    assert '--budget-seconds "$(left)"' in install  # the install is bounded by the command's budget too


def replay(tmp_path, monkeypatch, slow: float) -> tuple[list[str], list[int]]:
    """The first plan's commands as a node would run them (each command's unit budget, the first, then the second,
    again), each fake unit taking its estimate times ``slow``. Returns the units run and each command's exit code."""
    monkeypatch.setattr(verify, "probe_versions", lambda args, work, env, budget: dict(H100))
    clock, calls = [0.0], []
    real_budget = runs.Budget
    monkeypatch.setattr(verify.runs, "Budget", lambda s: real_budget(s, clock=lambda: clock[0]))

    def runner(ctx, unit):
        calls.append(unit.id)
        clock[0] += unit.estimate_s * slow
        return {"status": "passed"}

    for step in units.STEPS:
        monkeypatch.setitem(verify.RUNNERS, step, runner)
    results = tmp_path / "r.jsonl"
    codes = []
    for i in range(8):
        budget = units.COMMANDS[min(i, 1)].units_s
        codes.append(verify.main(["--plan", "first", "--budget-seconds", str(budget), "--results", str(results),
                                  "--work", str(tmp_path / "w"), "--mirror", str(tmp_path / "out")]))
        if codes[-1] == 0:
            break
    recorded = [r["unit"] for r in runs.load(results) if r.get("key") == KEY and r["unit"] != "versions"]
    assert recorded == calls
    return calls, codes


def test_at_the_estimates_the_commands_run_as_the_plan_packs_them(tmp_path, monkeypatch):
    calls, codes = replay(tmp_path, monkeypatch, 1.0)
    packed = units.first_visit().commands
    assert calls == FIRST and calls[:len(packed[0])] == [u.id for u in packed[0]]
    assert codes[0] == codes[1] == verify.EXIT_MORE and codes[-1] == 0
    first_two = len(packed[0]) + len(packed[1])
    assert calls[len(packed[0]):first_two] == [u.id for u in packed[1]]


@pytest.mark.parametrize("slow", [1.3, 2.0])
def test_a_slower_node_records_everything_over_more_commands(tmp_path, monkeypatch, slow):
    """Slower than the estimates, every command stops before a unit that would not fit and the next one continues
    there: everything recorded, in order, nothing run twice."""
    calls, codes = replay(tmp_path, monkeypatch, slow)
    assert calls == FIRST and codes[-1] == 0 and len(codes) > 3


def test_a_command_on_another_driver_or_an_h200_goes_on_with_the_plan(tmp_path, monkeypatch):
    """The resume key is the GPU architecture and the library versions: a command that lands on another driver
    runs nothing twice; one that lands on an H200 does not repeat the tests either, only measures its own
    numbers. Every record names its GPU and driver."""
    import versions

    calls = []
    for step in units.STEPS:
        monkeypatch.setitem(verify.RUNNERS, step, lambda ctx, unit: calls.append(unit.id) or {"status": "passed"})
    results = tmp_path / "r.jsonl"
    argv = ["--plan", "first", "--results", str(results), "--work", str(tmp_path / "w")]
    nodes = [dict(H100), {**H100, "driver": "575.57.08"}, {**H100, "gpu": "NVIDIA H200", "driver": "575.57.08"}]
    for node in nodes:
        node["key"] = versions.key(node)
    assert len({n["key"] for n in nodes}) == 1
    for node in nodes:
        monkeypatch.setattr(verify, "probe_versions", lambda args, work, env, budget, node=node: dict(node))
        assert verify.main(argv) == 0
    measured = [u for u in FIRST if not u.startswith("pytest/")]  # the memory and the estimates are per GPU too
    assert calls == FIRST + measured
    records = [r for r in runs.load(results) if r["unit"] != "versions"]
    assert [(r["gpu"], r["driver"]) for r in records] == [(H100["gpu"], H100["driver"])] * len(FIRST) + [
        ("NVIDIA H200", "575.57.08")] * len(measured)


def test_the_committed_rehearsal_ended_each_command_inside_its_budget():
    """docs/gpu-rehearsal.json: the first visit's two commands rehearsed on CPU with the real kit (visit.sh
    --rehearse): each ended inside its VISIT_SECONDS, below its limit, with the plan's limits and worst case."""
    import json

    rec = json.loads((VISIT.parents[2] / "docs" / "gpu-rehearsal.json").read_text())
    assert [c["limit_s"] for c in rec["commands"]] == [c.limit_s for c in units.COMMANDS] == rec["plan"]["limits_s"]
    for c, plan in zip(rec["commands"], units.COMMANDS):
        assert c["VISIT_SECONDS"] == plan.budget_s and c["wall_s"] <= plan.budget_s + 2 < plan.limit_s
    assert rec["plan"]["visit_worst_s"] == units.first_visit().worst_s() <= 780
    assert "reused the install" in " ".join(rec["commands"][1]["install"])  # the second command reused the first's
    assert "/tmp" not in json.dumps(rec) and "/work" not in json.dumps(rec)
