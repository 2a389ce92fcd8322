"""`python -m llama_fp8 estimate`: the train flags plus the cluster and the GPU; the report, the JSON, the verdict
and its exit code, suggestions that are each an estimate, the stand-in for an implementation that cannot run
here, refusals that name the flag. Each estimate flag has a test of its effect (ESTIMATE_FLAG_TESTS)."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from llama_fp8 import config
from llama_fp8.config.estimate_flags import EstimateOptions, parse_estimate_args
from llama_fp8.estimate import assess, cli, gpus

TINY = ["--model", "tiny", "--num_layers", "2", "--max_context_width", "128", "--train_batch_size", "2"]

ESTIMATE_FLAG_TESTS = {
    "nodes": ["test_cluster_shape_sets_the_world_and_the_links"],
    "gpus_per_node": ["test_cluster_shape_sets_the_world_and_the_links"],
    "gpu": ["test_gpu_and_its_memory_decide_the_verdict"],
    "gpu_memory_gib": ["test_gpu_and_its_memory_decide_the_verdict",
                       "test_does_not_fit_exits_4_and_each_suggestion_is_its_own_estimate"],
    "suggest": ["test_does_not_fit_exits_4_and_each_suggestion_is_its_own_estimate"],
    "json": ["test_json_carries_the_reports_numbers"],
}


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_every_estimate_flag_has_a_test_of_its_effect():
    names = {n.name for n in ast.parse(Path(__file__).read_text()).body if isinstance(n, ast.FunctionDef)}
    assert set(ESTIMATE_FLAG_TESTS) == {f.name for f in dataclasses.fields(EstimateOptions)}
    assert not [t for tests in ESTIMATE_FLAG_TESTS.values() for t in tests if t not in names]


@pytest.mark.parametrize("train_line", [
    ["--model", "llama3.1-8b", "--fp8", "1", "--activation_checkpointing", "selective"],
    ["--model", "tiny", "--tp_size", "2", "--train_batch_size", "8", "--grad_accum_steps", "4"],
    ["--config", "configs/llama2-7b.yaml", "--max_context_width", "2048", "--sharding_strategy", "hybrid"],
])
def test_any_train_command_line_is_an_estimate_command_line(train_line, monkeypatch):
    from helpers import REPO

    monkeypatch.chdir(REPO)
    cfg, opts = parse_estimate_args(train_line + ["--nodes", "2"])
    assert cfg == config.parse_args(train_line) and opts.nodes == 2


def test_train_does_not_take_the_estimate_flags(capsys):
    with pytest.raises(SystemExit) as e:
        config.parse_args(["--nodes", "2"])
    assert e.value.code == 2 and "--nodes" in capsys.readouterr().err


def test_the_report_has_every_part_and_progress_goes_to_stderr(capsys):
    code, out, err = run_main(capsys, *TINY)
    assert code == 0
    for part in ("tracked peak", "at: backward, outside the model's modules (the loss)", "What the tracker cannot see",
                 "CUDA context", "NCCL buffers (dp_shard)", "allocator margin", "Verdict against H100", "fits:",
                 "Communication per step", "all_gather", "reduce_scatter", "Sources:", "[1]", "to calibrate"):
        assert part in out, part
    assert "[estimate" in err and "tracked step" in err and "[estimate" not in out


def test_json_carries_the_reports_numbers(capsys):
    code, out, _ = run_main(capsys, *TINY, "--json")
    d = json.loads(out)
    e = assess.estimate(config.parse_args(TINY), EstimateOptions())
    assert code == 0 and d["peak_bytes"] == e.measurement.peak_bytes == sum(d["peak_by_kind"].values())
    assert d["verdict"]["needed"] == d["peak_bytes"] + sum(t["bytes"] for t in d["terms"] if t["added"])
    assert d["verdict"]["status"] == "fits" and d["world_size"] == 8 and d["mesh"] == {"dp_shard": 8}
    assert {c["kind"] for c in d["collectives"]} >= {"all_gather", "reduce_scatter"}
    assert all(not t["calibrated"] for t in d["terms"])  # nothing measured on a GPU yet


def test_cluster_shape_sets_the_world_and_the_links(capsys):
    _, out, _ = run_main(capsys, *TINY, "--tp_size", "2", "--nodes", "3", "--gpus_per_node", "4", "--json")
    d = json.loads(out)
    assert d["world_size"] == 12 and d["mesh"] == {"dp_shard": 6, "tp": 2}
    links = {c["dim"]: (c["ranks"], c["link"]) for c in d["collectives"]}
    assert links["tp"] == (2, "NVLink") and links["dp_shard"] == (6, "network")  # dp_shard crosses the 3 nodes
    _, out, _ = run_main(capsys, *TINY, "--nodes", "1", "--gpus_per_node", "4", "--json")
    assert {c["link"] for c in json.loads(out)["collectives"]} == {"NVLink"}


def test_gpu_and_its_memory_decide_the_verdict(capsys):
    _, out, _ = run_main(capsys, *TINY, "--gpu", "H200", "--json")
    assert json.loads(out)["verdict"]["memory"] == gpus.GPUS["H200"].memory_bytes
    code, out, _ = run_main(capsys, *TINY, "--gpu", "A100-40GB", "--gpu_memory_gib", "0.5", "--suggest", "0", "--json")
    d = json.loads(out)
    assert code == cli.EXIT_DOES_NOT_FIT and d["verdict"]["memory"] == 2**29 and d["verdict"]["status"] == "does not fit"
    assert d["gpu"]["nvlink_gbs"] == gpus.GPUS["A100-40GB"].nvlink_gbs


def test_does_not_fit_exits_4_and_each_suggestion_is_its_own_estimate(capsys):
    base = assess.estimate(config.parse_args(TINY), EstimateOptions())
    selective = assess.estimate(config.parse_args(TINY + ["--activation_checkpointing", "selective"]),
                                EstimateOptions())
    assert selective.verdict.needed + selective.verdict.margin < base.verdict.needed
    between = (selective.verdict.needed + selective.verdict.margin + base.verdict.needed) / 2 / 2**30
    code, out, _ = run_main(capsys, *TINY, "--gpu_memory_gib", f"{between:.9f}", "--json")
    d = json.loads(out)
    assert code == cli.EXIT_DOES_NOT_FIT and d["verdict"]["status"] == "does not fit"
    by_change = {s["change"].split(" (")[0]: s for s in d["suggestions"]}
    assert set(by_change) == {"--activation_checkpointing selective", "--train_batch_size 1 --grad_accum_steps 2",
                              "--nodes 2", "--tp_size 2"}
    assert by_change["--activation_checkpointing selective"]["status"] == "fits"
    assert by_change["--activation_checkpointing selective"]["needed"] == selective.verdict.needed
    code, out, _ = run_main(capsys, *TINY, "--gpu_memory_gib", f"{between:.9f}", "--suggest", "0", "--json")
    assert code == cli.EXIT_DOES_NOT_FIT and json.loads(out)["suggestions"] == []


@pytest.mark.parametrize(("argv", "words"), [
    (["--nodes", "0"], "--nodes 0"),
    (["--gpus_per_node", "x"], "--gpus_per_node 'x'"),
    (["--gpu", "X100"], "--gpu 'X100' is not valid; valid: H100"),
    (["--gpu_memory_gib", "-1"], "--gpu_memory_gib -1"),
    (["--suggest", "2"], "--suggest '2'"),
    (["--cpu_offload", "1"], "--cpu_offload 1 cannot be estimated"),
    (["--optimizer", "adamw8bit"], "--optimizer adamw8bit cannot be estimated"),
    (["--cp_size", "2"], "cannot be estimated: --cp_size 2 with the Hugging Face model needs CUDA"),
    (["--tp_size", "3", "--gpus_per_node", "6"], "--num_heads 4 is not divisible by --tp_size 3"),
])
def test_refusals_name_the_flag_and_exit_2(capsys, argv, words):
    code, out, err = run_main(capsys, *TINY, *argv)
    assert code == 2 and words in err and out == ""


def test_a_mistyped_flag_exits_2_with_a_suggestion(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*TINY, "--nodez", "2"])
    assert e.value.code == 2 and "did you mean --nodes" in capsys.readouterr().err


def test_an_implementation_that_cannot_run_here_is_estimated_through_a_stated_stand_in(capsys):
    from llama_fp8 import models

    te = models.get("te")
    if te.unavailable(assess.build.CUDA) is None:
        pytest.skip("Transformer Engine imports here: this test is about a machine without it")
    code, out, _ = run_main(capsys, *TINY, "--model_impl", "te", "--activation_checkpointing", "1", "--json")
    d = json.loads(out)
    assert code == 0 and d["model_impl"] == "hf" and "--model_impl te" in d["stand_in"]
    assert "stand-in" not in json.dumps(d["notes"]) and "approximation" in d["stand_in"]
    _, text, _ = run_main(capsys, *TINY, "--model_impl", "te", "--activation_checkpointing", "1")
    assert "STAND-IN: --model_impl te" in text
    # what the TE model itself refuses is refused here too, Transformer Engine installed or not
    code, out, err = run_main(capsys, *TINY, "--model_impl", "te", "--activation_checkpointing", "selective")
    assert code == 2 and out == "" and "the TE model checkpoints whole blocks" in err
    assert run_main(capsys, *TINY, "--model_impl", "te", "--tp_size", "2")[0] == 2
    assert "unavailable" not in vars(te)  # the availability override is gone again
    # through a stand-in, "does not fit" is its own exit code: a warning, never a stopped job (test_prejob.py)
    code, out, _ = run_main(capsys, *TINY, "--model_impl", "te", "--activation_checkpointing", "1",
                            "--gpu_memory_gib", "0.5", "--suggest", "0", "--json")
    assert code == cli.EXIT_STAND_IN_DOES_NOT_FIT == 5 and json.loads(out)["verdict"]["status"] == "does not fit"


def test_where_the_peak_is_follows_the_shapes():
    wide_mlp = TINY + ["--vocab_size", "64", "--intermediate_size", "4096"]
    e = assess.estimate(config.parse_args(wide_mlp), EstimateOptions())
    assert e.measurement.where.phase == "backward" and e.measurement.where.module.startswith("model.layers.1")


def test_hybrid_sharding_all_reduces_across_nodes_and_reduce_scatters_within(capsys):
    _, out, _ = run_main(capsys, *TINY, "--sharding_strategy", "hybrid", "--nodes", "2", "--gpus_per_node", "4",
                         "--json")
    d = json.loads(out)
    assert d["mesh"] == {"dp_replicate": 2, "dp_shard": 4}
    by = {(c["kind"], c["dim"]): c for c in d["collectives"] if c["phase"] == "backward"}
    reduce_scatter, all_reduce = by[("reduce_scatter", "dp_shard")], by[("all_reduce", "dp_replicate")]
    assert reduce_scatter["link"] == "NVLink" and all_reduce["link"] == "network" and all_reduce["ranks"] == 2
    assert all_reduce["bytes"] * 4 == reduce_scatter["bytes"]  # each replica all-reduces its FP32 shard (1/4)
