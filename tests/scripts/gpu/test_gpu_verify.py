"""scripts/gpu/verify.py without a GPU: the command line of every unit (checked by the trainer's own parser),
selection, the budget and the resume-where-it-stopped logic, argument errors, --list / --dry-run, and one real
CPU run through the trainer. The GPU probe is replaced by a fixed H100 versions record where noted."""

from __future__ import annotations

import shlex
import tarfile
from pathlib import Path

import pytest
import runs
import steps
import units
import verify

from llama_fp8.config import parse_args

H100 = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "capability": "9.0", "torch": "2.11.0+cu130",
        "cuda": "13.0", "transformer_engine": "2.20.2", "torchao": "0.18.0", "transformers": "5.17.0",
        "cudnn": "9.13.0", "nccl": "2.27.7", "key": "sm90-0123456789"}
KEY = H100["key"]
DEMO = (Path("/demo/corpus"), Path("/demo/tokenizer"))


def train_argv(cmd: list[str]) -> list[str]:
    i = cmd.index("train")
    assert cmd[i - 2:i] == ["-m", "llama_fp8"], cmd
    return cmd[i + 1:]


@pytest.mark.slow
def test_every_matrix_cell_is_accepted_by_the_trainers_parser(tmp_path):
    opts = units.Options()
    cells = [u for u in units.plan(opts) if u.step == "train"]
    assert len([u for u in cells if u.info["pair"] == 1]) == 3 * 9
    assert [u.id for u in cells if u.info["pair"] > 1] == [f"train/llama3.2-1b/synthetic/{v}/pair2"
                                                            for v in ("te-fp8-current", "te-bf16")]
    for unit in cells:
        v = units.VARIANT[unit.info["variant"]]
        cfg = parse_args(units.train_flags(opts, unit.info["model"], v, tmp_path / "run", unit.info["seed"]))
        assert (cfg.seed, cfg.device, cfg.max_context_width) == (units.SEED + unit.info["pair"] - 1, "cuda", 4096)
        assert cfg.max_steps == 40 and cfg.logging_freq == 5 and cfg.dataset == "synthetic"
        assert cfg.model_impl == v.impl and cfg.fp8 == v.fp8 and cfg.compile == v.compile
        if v.fp8:
            assert (cfg.fp8_backend, cfg.fp8_recipe) == (v.backend, v.recipe)
        assert cfg.activation_checkpointing == ("full" if unit.info["model"] == "llama3.2-3b" else "none")
        if unit.info["model"] == "llama2-7b-8l":
            assert (cfg.model, cfg.num_layers, cfg.hidden_width) == ("llama2-7b", 8, 4096)
    hf_fp8 = [units.VARIANT[n] for n in ("hf-fp8-tensorwise", "hf-fp8-rowwise")]
    assert all(v.compile and v.backend == "torchao" for v in hf_fp8)  # torchao FP8 is measured compiled
    assert not any(v.compile for v in units.VARIANTS if v.impl == "te")  # TE delayed refuses compile


def test_units_run_in_the_plans_order_and_select_by_step_and_glob():
    plan = units.plan(units.Options())
    first = units.plan(units.Options(), "first")
    assert plan[:len(first)] == first  # a later visit goes on with what the first one left
    rest = plan[len(first) + 3:]
    steps = [u.step for u in rest]
    assert [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s] == ["pytest", "train"]
    assert [u.id for u in rest[:3]] == ["pytest/te", "pytest/other", "pytest/estimate"]  # the TE path first
    picked = units.select(plan, ("train",), ("train/llama3.2-1b/synthetic/te-*",))
    assert [u.id for u in picked] == [f"train/llama3.2-1b/synthetic/{x}" for x in (
        "te-bf16", "te-fp8-current", "te-fp8-current/pair2", "te-bf16/pair2", "te-fp8-delayed", "te-fp8-block",
        "te-fp8-mxfp8")]
    assert units.select(plan, ("memory",), None) == [u for u in plan if u.step == "memory"]


@pytest.fixture
def fake_gpu(monkeypatch):
    """The versions probe answers as on an H100 (the probe itself: tests/scripts/offline/test_versions.py)."""
    monkeypatch.setattr(verify, "probe_versions", lambda args, work, env, budget: dict(H100))


@pytest.mark.parametrize("argv,message", [
    (["--only", "train,gpu"], "--only gpu: not a step"),
    (["--models", "llama9"], "--models llama9: valid"),
    (["--max-steps", "0"], "--max-steps 0: must be >= 1"),
    (["--warmup-steps", "50"], "--warmup-steps 50: must be >= 0 and below --max-steps"),
    (["--budget-seconds", "0"], "--budget-seconds 0.0: must be > 0"),
    (["--data", "text"], "unrecognized arguments: --data text"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        verify.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def fake_runner(clock: list[float], statuses: dict[str, list[str]], calls: list[str]):
    """Stands in for the GPU runs: takes 100 s of (fake) time, answers the next status listed for the unit."""
    def run(ctx, unit):
        calls.append(unit.id)
        clock[0] += 100
        return {"status": statuses.get(unit.id, ["passed"]).pop(0) if statuses.get(unit.id) else "passed"}
    return run


def test_budget_stops_before_a_unit_that_does_not_fit_and_the_next_run_goes_on(tmp_path, monkeypatch, capsys,
                                                                                fake_gpu):
    clock, calls = [0.0], []
    real_budget = runs.Budget
    monkeypatch.setattr(verify.runs, "Budget", lambda s: real_budget(s, clock=lambda: clock[0]))
    statuses = {"pytest/other": ["interrupted", "failed", "passed"]}
    monkeypatch.setitem(verify.RUNNERS, "pytest", fake_runner(clock, statuses, calls))
    results, mirror = tmp_path / "r.jsonl", tmp_path / "out"
    argv = ["--only", "pytest", "--match", "pytest/te", "--match", "pytest/other", "--match", "pytest/estimate",
            "--budget-seconds", "650", "--results", str(results), "--work", str(tmp_path / "w"), "--mirror", str(mirror)]
    # 1st: unit 1 (100 s), unit 2 interrupted (by the budget, says the runner): stop, more to do
    assert verify.main(argv) == verify.EXIT_MORE
    assert calls == ["pytest/te", "pytest/other"]
    # 2nd: unit 2 again (fails: final), then unit 3; 3rd: nothing left; 4th with --retry: the failed unit 2 again
    assert verify.main(argv) == 0
    assert calls[2:] == ["pytest/other", "pytest/estimate"]
    assert verify.main(argv) == 0 and len(calls) == 4
    assert verify.main(argv + ["--retry"]) == 0 and calls[4:] == ["pytest/other"]
    # with 350 s: unit 1 (100 s) leaves 250, unit 2 needs ~300: stopped before it, nothing recorded for it
    other = tmp_path / "r2.jsonl"
    i = argv.index("--budget-seconds")
    assert verify.main([*argv[:i + 1], "350", "--results", str(other), *argv[i + 4:]]) == verify.EXIT_MORE
    assert "stopping here" in capsys.readouterr().out
    assert [r["unit"] for r in runs.load(other)] == ["versions", "pytest/te"]
    records = runs.load(results)
    assert [r["unit"] for r in records if r["unit"] == "versions"] == ["versions"]  # once per key
    assert all(r["key"] == KEY and r.get("src_sha") for r in records)
    assert (mirror / "r.jsonl").read_text() == results.read_text()
    assert (mirror / "r2.jsonl").read_text() == other.read_text()
    with tarfile.open(mirror / "logs.tar.gz") as tar:
        assert "logs/versions.log" not in tar.getnames()  # the probe was faked here: nothing logged
    assert verify.main(argv + ["--list"]) == 0
    listing = capsys.readouterr().out
    assert "passed       ~ 300s  pytest/other" in listing


def test_train_outcomes_are_classified(tmp_path):
    log = tmp_path / "log"

    def outcome(rc, text, timed_out=False):
        log.write_text(text)
        return runs.Outcome(rc, timed_out, 1.0, log)

    v = units.VARIANT
    refusal = "llama-fp8 train: error: --fp8_recipe mxfp8 needs compute capability >= 10.0 (this GPU: 9.0)\n"
    assert steps.train_outcome(outcome(2, refusal), None, v["te-fp8-mxfp8"], tmp_path, 0)["status"] == "refused"
    assert steps.train_outcome(outcome(2, refusal), None, v["te-fp8-block"], tmp_path, 0)["status"] == "refused"
    assert steps.train_outcome(outcome(2, refusal), None, v["te-fp8-delayed"], tmp_path, 0)["status"] == "failed"
    crash = "Traceback (most recent call last):\nRuntimeError: CUDA error\n"
    assert steps.train_outcome(outcome(2, crash), None, v["te-fp8-mxfp8"], tmp_path, 0)["status"] == "failed"
    ran = steps.train_outcome(outcome(0, ""), None, v["te-fp8-mxfp8"], tmp_path, 0)
    assert ran["status"] == "failed" and "must be refused" in ran["message"]
    assert steps.train_outcome(outcome(0, ""), None, v["te-bf16"], tmp_path, 0)["status"] == "error"  # no metrics
    for killed in ("timeout", "interrupted"):
        assert steps.train_outcome(outcome(None, "", True), killed, v["te-bf16"], tmp_path, 0)["status"] == killed


@pytest.mark.slow
def test_a_real_cpu_cell_is_recorded_once(tmp_path, capsys):
    """The real probe and the real trainer (tiny, CPU): the record holds the command and the numbers; the same
    command again runs nothing."""
    results = tmp_path / "r.jsonl"
    argv = ["--device", "cpu", "--models", "tiny", "--only", "train", "--match",
            "train/tiny/synthetic/hf-bf16", "--max-steps", "6", "--warmup-steps", "2", "--logging-freq", "2",
            "--results", str(results), "--work", str(tmp_path / "w"), "--mirror", str(tmp_path / "out")]
    assert verify.main(argv) == 0
    [versions, cell] = runs.load(results)
    assert versions["versions"]["gpu"] == "no GPU" and cell["key"] == versions["key"]
    assert cell["status"] == "passed" and cell["timed_steps"] == 4 and cell["warmup_steps"] == 2
    assert [s for s, _ in cell["losses"]] == [2, 4, 6] and cell["tokens_per_sec_per_device"] > 0
    assert parse_args(train_argv(shlex.split(cell["command"]))).max_steps == 6
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        names = tar.getnames()
    assert "runs/train_tiny_synthetic_hf-bf16/metrics.jsonl" in names and "logs/versions.log" in names
    capsys.readouterr()
    assert verify.main(argv) == 0
    assert "0 of 1 selected units to run" in capsys.readouterr().out and len(runs.load(results)) == 2


def test_a_rehearsal_runs_cpu_twins_and_keeps_its_records_out_of_the_repository(tmp_path, capsys, monkeypatch,
                                                                                    fake_gpu):
    """--rehearse: a training cell runs as its CPU twin (tiny, HF model, eager, torchao FP8 emulated: TE needs
    CUDA), the estimate runs the cell's real configuration as on the node, and the records go to the work dir."""
    seen = []

    def timebox(cmd, timeout, log, env=None, cwd=None):  # the command each unit would run, not run
        seen.append(cmd)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        return runs.Outcome(1, False, 0.0, log)

    monkeypatch.setattr(runs, "timebox", timebox)
    argv = ["--plan", "first", "--rehearse", "--work", str(tmp_path / "w"), "--match", "train/*", "--match",
            "estimate/*"]
    committed = verify.REPO / "docs" / "gpu-results" / "results.jsonl"  # a visit's records, once one is committed
    before = committed.read_bytes() if committed.exists() else None
    assert verify.main(argv) == 0
    lines = [c for c in seen if "llama_fp8" in c]
    trains = [parse_args(train_argv(c)) for c in lines if "train" in c]
    assert [(c.model, c.model_impl, c.fp8, c.compile, c.device) for c in trains[:2]] == [
        ("tiny", "hf", False, False, "cpu"), ("tiny", "hf", True, False, "cpu")]
    assert trains[1].fp8_backend == "torchao" and trains[2].seed == 1235
    estimates = [c for c in lines if "estimate" in c]
    flags = estimates[0][estimates[0].index("estimate") + 1:]
    assert flags[flags.index("--model") + 1] == "llama3.2-1b" and flags[flags.index("--device") + 1] == "cuda"
    assert flags[flags.index("--model_impl") + 1] == "te" and "--json" in flags
    assert (committed.read_bytes() if committed.exists() else None) == before  # the rehearsal's went to the work dir
    assert runs.load(tmp_path / "w" / "rehearsal.jsonl")
    calls = []
    for step in units.STEPS:
        monkeypatch.setitem(verify.RUNNERS, step, lambda ctx, unit: calls.append(ctx.opts.device) or {"status": "passed"})
    (tmp_path / "w" / "rehearsal.jsonl").unlink()
    assert verify.main(["--plan", "first", "--rehearse", "--work", str(tmp_path / "w"), "--match", "memory/*"]) == 0
    assert calls == ["cpu"] and [r["unit"] for r in runs.load(tmp_path / "w" / "rehearsal.jsonl")] == [
        "versions", "memory/terms"]


def test_merge_from_carries_the_repositorys_records_into_the_nodes_file(tmp_path, monkeypatch, fake_gpu):
    """visit.sh runs verify with the node's own results file and --merge-from the repository's: what the repository
    holds (an earlier visit, taken back) is not run again, and a second command on the same node, whose
    repository copy lacks the first command's records, finds them in the node's file."""
    calls = []
    for step in units.STEPS:
        monkeypatch.setitem(verify.RUNNERS, step, lambda ctx, unit: calls.append(unit.id) or {"status": "passed"})
    repo_file, node_file = tmp_path / "repo.jsonl", tmp_path / "node" / "results.jsonl"
    runs.Store(repo_file).append({"key": KEY, "gpu": H100["gpu"], "unit": "memory/terms", "kind": "memory",
                                  "status": "passed"})
    argv = ["--plan", "first", "--results", str(node_file), "--merge-from", str(repo_file), "--work",
            str(tmp_path / "w"), "--match", "memory/*", "--match", "estimate/*"]
    assert verify.main(argv) == 0
    assert calls == ["estimate/llama3.2-1b/synthetic/te-fp8-current", "estimate/llama3.2-1b/synthetic/te-bf16"]
    mirror = tmp_path / "out2"
    assert verify.main(argv + ["--mirror", str(mirror)]) == 0 and len(calls) == 2  # the second command: nothing again
    assert (mirror / "results.jsonl").read_text() == node_file.read_text()  # its output folder holds every record
    units_in_node = [r["unit"] for r in runs.load(node_file)]
    assert units_in_node.count("memory/terms") == 1 and len(units_in_node) == 4  # merged once, + versions, 2 estimates
    assert verify.main([*argv[:4], "--merge-from", str(tmp_path / "missing.jsonl"), *argv[6:]]) == 0  # no file: fine
