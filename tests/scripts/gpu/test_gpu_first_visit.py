"""The first visit of a GPU node, rehearsed on CPU with fake timings: its units ordered by value (the headline
first), its declared budget inside one visit of 15 minutes (the node's start, one command of at most 9 minutes and
an optional second of at most 3, the installs and the idle gap included: the size check that keeps the plan from
growing past one visit), and the commands recording everything, each continuing where the last stopped."""

from __future__ import annotations

import pytest
import runs
import units
import verify
from test_gpu_verify import H100, KEY

HEADLINE = ["train/llama3.2-1b/synthetic/te-bf16", "train/llama3.2-1b/synthetic/te-fp8-current",
            "train/llama3.2-1b/synthetic/te-fp8-current/pair2", "train/llama3.2-1b/synthetic/te-bf16/pair2"]
FIRST = HEADLINE + ["memory/terms", "estimate/llama3.2-1b/synthetic/te-bf16",
                    "estimate/llama3.2-1b/synthetic/te-fp8-current", "train/llama3.2-1b/synthetic/hf-bf16",
                    "pytest/te-logits"]


def test_the_first_plan_is_ordered_by_value():
    """The headline's interleaved pairs (bf16 fp8, fp8 bf16; one seed per pair), then the memory terms and the
    estimates of exactly the headline's two configurations, then HF BF16 (HF BF16 -> TE FP8 with the headline's
    FP8 runs), then the TE value tests."""
    plan = units.plan(units.Options(), "first")
    assert [u.id for u in plan] == FIRST
    head = plan[:4]
    assert [(u.info["variant"], u.info["pair"], u.info["seed"]) for u in head] == [
        ("te-bf16", 1, 1234), ("te-fp8-current", 1, 1234), ("te-fp8-current", 2, 1235), ("te-bf16", 2, 1235)]
    assert {u.info["impl"] for u in head} == {"te"} and not any(u.info["compile"] for u in head)
    estimates = [u for u in plan if u.step == "estimate"]
    assert [u.info["cell"] for u in estimates] == HEADLINE[:2]
    assert plan[-1].info["args"] == list(units.TE_LOGITS_TESTS)
    # plan all: the first visit's units first, then what it leaves of (d): TE FP8 save/resume and the compiled
    # torchao pair; each unit once
    everything = units.plan(units.Options())
    assert [u.id for u in everything[:len(FIRST) + 3]] == FIRST + [
        "pytest/te-resume", "train/llama3.2-1b/synthetic/hf-bf16-compile", "train/llama3.2-1b/synthetic/hf-fp8-tensorwise"]
    assert everything[len(FIRST)].info["args"] == list(units.TE_RESUME_TESTS)
    assert all(u.info["compile"] for u in everything[len(FIRST) + 1:len(FIRST) + 3])
    assert len({u.id for u in everything}) == len(everything)


def test_the_first_visit_fits_one_visit_of_15_minutes():
    """The plan's declared budget: node start + (install + margin + units) per command + the idle gap, by the
    estimates, within 15 minutes; the first command within 9 minutes and holding the headline, the optional second
    within 3. Adding a unit of a minute breaks it (the check can fail)."""
    budget = units.first_visit()
    assert len(budget.commands) <= 2
    assert budget.command_s[0] <= 9 * 60 and budget.command_s[0] <= units.COMMANDS_S[0]
    assert all(s <= 3 * 60 for s in budget.command_s[1:]) and units.COMMANDS_S[1] <= 3 * 60
    assert budget.total_s <= units.VISIT_S == 15 * 60
    assert budget.total_s == (units.NODE_START_S + sum(budget.command_s) + units.GAP_S * (len(budget.commands) - 1))
    assert all(s == units.INSTALL_S + units.MARGIN_S + sum(u.estimate_s for u in c)
               for c, s in zip(budget.commands, budget.command_s))
    assert [u.id for u in budget.commands[0][:4]] == HEADLINE  # the headline in the main command
    assert units.NODE_START_S >= 60 and units.INSTALL_S >= 45  # the fixed costs are counted, not left out
    extra = units.Unit("train/extra", "train", 60, 480)
    grown = units.first_visit(units.first_plan() + [extra])
    assert len(grown.commands) > 2 or grown.total_s > units.VISIT_S or grown.command_s[-1] > units.COMMANDS_S[-1]
    assert any(line.startswith("visit: ~") for line in budget.lines())


def replay(tmp_path, monkeypatch, slow: float) -> tuple[list[str], list[int]]:
    """Run the first plan's commands as visits would (a 9-minute command, then a 3-minute one, again), each fake
    unit taking its estimate times ``slow``. Returns the units run and each command's exit code."""
    monkeypatch.setattr(verify, "probe_versions", lambda args, work, env: dict(H100))
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
    for i in range(6):
        budget = units.command_budget(units.COMMANDS_S[i % 2])
        codes.append(verify.main(["--plan", "first", "--budget-seconds", str(budget), "--results", str(results),
                                  "--work", str(tmp_path / "w"), "--mirror", str(tmp_path / "out")]))
        if codes[-1] == 0:
            break
    recorded = [r["unit"] for r in runs.load(results) if r.get("key") == KEY and r["unit"] != "versions"]
    assert recorded == calls
    return calls, codes


def test_at_the_estimates_the_visit_runs_as_the_plan_packs_it(tmp_path, monkeypatch):
    calls, codes = replay(tmp_path, monkeypatch, 1.0)
    assert calls == FIRST  # in order, each once
    assert len(codes) == len(units.first_visit().commands) and codes[-1] == 0
    assert all(c == verify.EXIT_MORE for c in codes[:-1])


@pytest.mark.parametrize("slow", [1.3, 2.0])
def test_a_slower_node_records_everything_over_more_commands(tmp_path, monkeypatch, slow):
    """Slower than the estimates, every command stops before a unit that would not fit and the next one continues
    there: everything recorded, in order, nothing run twice."""
    calls, codes = replay(tmp_path, monkeypatch, slow)
    assert calls == FIRST and codes[-1] == 0 and len(codes) > len(units.first_visit().commands)


def test_a_command_on_another_driver_or_an_h200_goes_on_with_the_plan(tmp_path, monkeypatch):
    """The resume key is the GPU architecture and the library versions: a command that lands on another driver
    runs nothing twice; one that lands on an H200 does not repeat the tests either, only measures its own
    numbers (a number from an H100 is not an H200's). Every record names its GPU and driver."""
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
        monkeypatch.setattr(verify, "probe_versions", lambda args, work, env, node=node: dict(node))
        assert verify.main(argv) == 0
    measured = [u for u in FIRST if not u.startswith("pytest/")]  # the memory and the estimates are per GPU too
    assert calls == FIRST + measured
    records = [r for r in runs.load(results) if r["unit"] != "versions"]
    assert [(r["gpu"], r["driver"]) for r in records] == [(H100["gpu"], H100["driver"])] * len(FIRST) + [
        ("NVIDIA H200", "575.57.08")] * len(measured)
