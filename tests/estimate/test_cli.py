"""`python -m llama_fp8 estimate`: the train flags plus the cluster and the GPU; the report, the JSON, the verdict
and its exit code, suggestions that are each an estimate, the stand-in for an implementation that cannot run
here, refusals that name the flag. Each estimate flag has a test of its effect (ESTIMATE_FLAG_TESTS)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
from pathlib import Path

import pytest

from llama_fp8 import config
from llama_fp8.estimate import assess, cli, gpus, suggest
from llama_fp8.estimate.flags import EstimateOptions, build_estimate_parser, parse_estimate_args

TINY = ["--model", "tiny", "--num_layers", "2", "--max_context_width", "128", "--train_batch_size", "2", "--model_impl",
        "hf"]
TINY_AUTO = TINY[:-2]  # --model_impl auto: the TE model on a GPU node where Transformer Engine imports

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


@contextlib.contextmanager
def capsys_disabled_json(argv: list[str]):
    """(exit code, the JSON, the report) of ``argv``'s estimate, run twice (--json and text) without suggestions."""
    import io

    outs = []
    for extra in (["--json"], []):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main([*argv, "--suggest", "0", *extra])
        outs.append((code, buffer.getvalue()))
    assert outs[0][0] == outs[1][0]
    yield outs[0][0], json.loads(outs[0][1]), outs[1][1]


def test_every_estimate_flag_has_a_test_of_its_effect():
    names = {n.name for n in ast.parse(Path(__file__).read_text()).body if isinstance(n, ast.FunctionDef)}
    assert set(ESTIMATE_FLAG_TESTS) == {f.name for f in dataclasses.fields(EstimateOptions)}
    assert not [t for tests in ESTIMATE_FLAG_TESTS.values() for t in tests if t not in names]


def test_each_estimate_flag_has_one_help_text_with_its_default():
    """The field's help is the flag's help (the only text: the two used to disagree), with the field's default."""
    shown = {a.dest: " ".join(a.help.split()) for a in build_estimate_parser()._actions if a.help}
    for f in dataclasses.fields(EstimateOptions):
        assert shown[f.name].startswith(f.metadata["help"]), f.name
    assert shown["nodes"].endswith("(default: 1)") and shown["gpus_per_node"].endswith("8, 4 on GB200 and GB300)")
    assert shown["gpu"].endswith("(default: H100)") and shown["suggest"].endswith("(default: 1)")
    assert "default" not in shown["gpu_memory_gib"] + shown["json"]


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
    for part in ("tracked peak", "at: forward, in lm_head", "What the tracker cannot see",
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


@pytest.mark.slow
def test_cluster_shape_sets_the_world_and_the_links(capsys):
    _, out, _ = run_main(capsys, *TINY, "--tp_size", "2", "--nodes", "3", "--gpus_per_node", "4", "--json")
    d = json.loads(out)
    assert d["world_size"] == 12 and d["mesh"] == {"dp_shard": 6, "tp": 2}
    links = {c["dim"]: (c["ranks"], c["link"]) for c in d["collectives"]}
    assert links["tp"] == (2, "NVLink") and links["dp_shard"] == (6, "network")  # dp_shard crosses the 3 nodes
    _, out, _ = run_main(capsys, *TINY, "--nodes", "1", "--gpus_per_node", "4", "--json")
    assert {c["link"] for c in json.loads(out)["collectives"]} == {"NVLink"}
    _, out, _ = run_main(capsys, *TINY, "--nodes", "2", "--gpu", "GB200", "--json")  # the GPU's nodes: 4 GPUs each
    d = json.loads(out)
    assert d["gpus_per_node"] == 4 and d["world_size"] == 8
    assert {c["link"] for c in d["collectives"]} == {"NVLink (multi-node)"}  # 2 trays, one NVLink domain


def test_gpu_and_its_memory_decide_the_verdict(capsys):
    _, out, _ = run_main(capsys, *TINY, "--gpu", "H200", "--json")
    assert json.loads(out)["verdict"]["memory"] == gpus.GPUS["H200"].memory_bytes
    code, out, _ = run_main(capsys, *TINY, "--gpu", "A100-40GB", "--gpu_memory_gib", "0.5", "--suggest", "0", "--json")
    d = json.loads(out)
    assert code == cli.EXIT_DOES_NOT_FIT and d["verdict"]["memory"] == 2**29 and d["verdict"]["status"] == "does not fit"
    assert d["gpu"]["nvlink_gbs"] == gpus.GPUS["A100-40GB"].nvlink_gbs


@pytest.mark.slow
def test_does_not_fit_exits_4_and_each_suggestion_is_its_own_estimate(capsys):
    deep = TINY + ["--num_layers", "8", "--vocab_size", "512"]  # blocks whose activations outweigh the loss's chunk
    base = assess.estimate(config.parse_args(deep), EstimateOptions())
    selective = assess.estimate(config.parse_args(deep + ["--activation_checkpointing", "selective"]),
                                EstimateOptions())
    assert selective.verdict.needed + selective.verdict.margin < base.verdict.needed
    between = (selective.verdict.needed + selective.verdict.margin + base.verdict.needed) / 2 / 2**30
    code, out, _ = run_main(capsys, *deep, "--gpu_memory_gib", f"{between:.9f}", "--json")
    d = json.loads(out)
    assert code == cli.EXIT_DOES_NOT_FIT and d["verdict"]["status"] == "does not fit"
    by_change = {s["change"].split(" (")[0]: s for s in d["suggestions"]}
    assert set(by_change) == {"--activation_checkpointing selective", "--train_batch_size 1 --grad_accum_steps 2",
                              "--nodes 2", "--tp_size 2"}
    assert by_change["--activation_checkpointing selective"]["status"] == "fits"
    assert by_change["--activation_checkpointing selective"]["needed"] == selective.verdict.needed
    code, out, _ = run_main(capsys, *deep, "--gpu_memory_gib", f"{between:.9f}", "--suggest", "0", "--json")
    assert code == cli.EXIT_DOES_NOT_FIT and json.loads(out)["suggestions"] == []


@pytest.mark.parametrize(("argv", "words"), [
    (["--nodes", "0"], "--nodes 0"),
    (["--gpus_per_node", "x"], "--gpus_per_node 'x'"),
    (["--gpu", "X100"], "--gpu 'X100' is not valid; valid: H100"),
    (["--gpu_memory_gib", "-1"], "--gpu_memory_gib -1"),
    (["--gpu_memory_gib", "inf"], "--gpu_memory_gib inf is out of range; valid: a finite number > 0"),
    (["--gpu_memory_gib", "nan"], "--gpu_memory_gib nan is out of range"),
    (["--suggest", "2"], "--suggest '2'"),
    (["--cpu_offload", "1"], "--cpu_offload 1 cannot be estimated"),
    (["--optimizer", "adamw8bit"], "--optimizer adamw8bit cannot be estimated"),
    (["--cp_size", "2"], "cannot be estimated: --cp_size 2 with the Hugging Face model needs CUDA"),
    (["--cp_size", "2", "--model_impl", "te"],  # the TE model's own context parallelism, which its stand-in lacks
     "cannot be estimated through the stand-in --model_impl hf for --model_impl te: --cp_size 2"),
    (["--tp_size", "3", "--gpus_per_node", "6"], "--num_heads 4 is not divisible by --tp_size 3"),
])
def test_refusals_name_the_flag_and_exit_2(capsys, argv, words):
    code, out, err = run_main(capsys, *TINY, *argv)
    assert code == 2 and words in err and out == ""


def test_a_mistyped_flag_exits_2_with_a_suggestion(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*TINY, "--nodez", "2"])
    assert e.value.code == 2 and "did you mean --nodes" in capsys.readouterr().err


def te_cannot_run_here():
    from llama_fp8 import models

    if models.get("te").unavailable(assess.build.CUDA) is None:
        pytest.skip("Transformer Engine imports here: this test is about a machine without it")
    return models.get("te")


@pytest.mark.slow
def test_an_implementation_that_cannot_run_here_is_estimated_through_a_stated_stand_in(capsys):
    te = te_cannot_run_here()
    code, out, _ = run_main(capsys, *TINY, "--model_impl", "te", "--activation_checkpointing", "full", "--json")
    d = json.loads(out)
    assert code == 0 and d["model_impl"] == "hf" and "--model_impl te" in d["stand_in"]
    assert "stand-in" not in json.dumps(d["notes"]) and "approximation" in d["stand_in"]
    _, text, _ = run_main(capsys, *TINY, "--model_impl", "te", "--activation_checkpointing", "full")
    assert "STAND-IN: --model_impl te" in text
    # what the TE model itself refuses is refused here too, Transformer Engine installed or not
    code, out, err = run_main(capsys, *TINY, "--model_impl", "te", "--activation_checkpointing", "selective")
    assert code == 2 and out == "" and "the TE model checkpoints whole blocks" in err
    assert run_main(capsys, *TINY, "--model_impl", "te", "--tp_size", "2")[0] == 2
    assert "unavailable" not in vars(te)  # the availability override is gone again
    # through a stand-in, "does not fit" is its own exit code: a warning, never a stopped job (test_prejob.py),
    # unless what any implementation holds does not fit either (the floor, below)
    te_args = [*TINY, "--model_impl", "te", "--activation_checkpointing", "full"]
    code, out, _ = run_main(capsys, *te_args, "--gpu_memory_gib", between_floor_and_needed(capsys, te_args),
                            "--suggest", "0", "--json")
    assert code == cli.EXIT_STAND_IN_DOES_NOT_FIT == 5 and json.loads(out)["verdict"]["status"] == "does not fit"


def between_floor_and_needed(capsys, argv: list[str]) -> str:
    """A GPU memory (--gpu_memory_gib) above what any implementation of these shapes holds (the floor) and below
    what the estimated one needs."""
    code, out, _ = run_main(capsys, *argv, "--suggest", "0", "--json")
    d = json.loads(out)
    assert code == 0 and 0 < d["floor"]["bytes"] < d["verdict"]["needed"], d["floor"]
    return f"{(d['floor']['bytes'] + d['verdict']['needed']) / 2 / 2**30:.9f}"


@pytest.mark.slow
def test_auto_is_estimated_as_the_te_model_a_gpu_node_with_transformer_engine_runs(capsys):
    """``auto`` is the TE model on a GPU node where Transformer Engine imports (the default image). A machine
    without it (a login node) estimates that job through the stand-in and says so: its "does not fit" is the
    stand-in's exit code, as in the job's own container, never the HF model's 4 in silence."""
    te_cannot_run_here()
    memory = between_floor_and_needed(capsys, TINY_AUTO)
    code, out, _ = run_main(capsys, *TINY_AUTO, "--gpu_memory_gib", memory, "--suggest", "0", "--json")
    d = json.loads(out)
    assert code == cli.EXIT_STAND_IN_DOES_NOT_FIT and d["verdict"]["status"] == "does not fit"
    assert d["model_impl"] == "hf" and d["stand_in"].startswith("--model_impl auto picks te"), d["stand_in"]
    assert d["job_model_impl"] == "te"
    _, text, _ = run_main(capsys, *TINY_AUTO, "--gpu_memory_gib", memory, "--suggest", "0")
    assert "STAND-IN: --model_impl auto picks te" in text and "--model_impl te, estimated through hf)" in text
    # what the TE model refuses is refused for auto too (the job in the default image would be), with the way out
    code, out, err = run_main(capsys, *TINY_AUTO, "--activation_checkpointing", "selective")
    assert code == 2 and "the TE model checkpoints whole blocks" in err and "--model_impl hf" in err
    # --model_impl hf is the HF model, as before: its own verdict and exit code
    code, out, _ = run_main(capsys, *TINY, "--gpu_memory_gib", memory, "--suggest", "0", "--json")
    assert code == cli.EXIT_DOES_NOT_FIT and json.loads(out)["stand_in"] is None


def test_a_stand_ins_suggestions_are_those_the_jobs_implementation_takes():
    """The TE model checkpoints whole blocks only (--activation_checkpointing full) and has no tensor parallelism:
    the suggestions for a TE job are its changes, not the stand-in's (whose next level would be selective)."""
    te_cannot_run_here()
    e = assess.estimate(config.parse_args(TINY_AUTO + ["--model_impl", "te"]), EstimateOptions(suggest=False))
    assert e.measurement.decision.stand_in and e.measurement.decision.impl.name == "hf"
    found = {change.split(" (")[0]: cfg for change, cfg, _ in suggest.candidates(e)}
    assert found["--activation_checkpointing full"].activation_checkpointing == "full"
    assert found["--activation_checkpointing full"].model_impl == "te"  # estimated as the job's, i.e. its stand-in
    assert not [c for c in found if "selective" in c or c.startswith("--tp_size")], list(found)


@pytest.mark.parametrize(("argv", "words"), [
    (["--fp8_all_gather", "1", "--activation_checkpointing", "full"],
     "--fp8_all_gather 1 with --activation_checkpointing full"),
    (["--fp8_recipe", "block", "--fp8_all_gather", "1"], "--fp8_all_gather 1 with --fp8_recipe block"),
    (["--fp8_all_gather", "1", "--sharding_strategy", "hybrid", "--nodes", "2"], "works with plain FSDP only"),
    (["--fp8_recipe", "delayed", "--compile", "1"], "--fp8_recipe delayed cannot be combined with --compile 1"),
    (["--fp8_stats", "10", "--compile", "1"], "--fp8_stats with --fp8_backend te and --compile 1"),
    (["--fp8_backend", "torchao"], "--fp8_backend torchao does not work with --model_impl te"),
    (["--fp8_recipe", "rowwise"], "--fp8_recipe rowwise is a recipe of --fp8_backend torchao"),
])
def test_what_training_refuses_for_the_te_model_the_estimate_refuses(capsys, argv, words):
    """TE's FP8 refusals of the flags alone (no library, no GPU needed to make them), made on a machine without
    Transformer Engine too, before the stand-in (which has another FP8 backend) is chosen."""
    code, out, err = run_main(capsys, *TINY, "--model_impl", "te", "--fp8", "1", *argv)
    assert code == 2 and words in err and out == "", err[-600:]


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


@pytest.mark.slow
def test_through_a_stand_in_what_any_implementation_holds_still_decides():
    """Through a stand-in the activations are an approximation, but the sharded parameters, gradients and AdamW
    states as the optimizer step starts (the same for any implementation of these shapes) and the GPU terms that
    do not depend on the implementation are not: when they alone exceed the memory, the job cannot fit (exit 4,
    a verdict the batch script stops on); above them, the stand-in's "does not fit" stays a warning (exit 5)."""
    args = [*TINY, "--model_impl", "te", "--activation_checkpointing", "full"]
    e = assess.estimate(config.parse_args(args), EstimateOptions(suggest=False))
    held = e.measurement.at_optimizer
    independent = [t for t in e.terms if t.added and t.any_implementation]
    assert {t.name.split(" (")[0] for t in independent} == {"CUDA context", "NCCL buffers",
                                                           "cuBLAS workspace"}
    assert e.floor == (held["Sharded Param"] + held["Sharded Grad"] + held["OptState"]
                       + sum(t.bytes for t in independent))
    assert held["OptState"] > 0 and e.floor < e.verdict.needed
    with capsys_disabled_json(args + ["--gpu_memory_gib", f"{0.99 * e.floor / 2**30:.9f}"]) as (code, d, text):
        assert code == cli.EXIT_DOES_NOT_FIT and d["floor"]["bytes"] == e.floor and d["stand_in"]
        assert "whatever the implementation" in text
    between = (e.floor + e.verdict.needed) / 2
    with capsys_disabled_json(args + ["--gpu_memory_gib", f"{between / 2**30:.9f}"]) as (code, d, text):
        assert code == cli.EXIT_STAND_IN_DOES_NOT_FIT and d["verdict"]["status"] == "does not fit"
        assert "the verdict above rests on the stand-in's activations" in text and not d["floor"]["decides"]


def test_the_estimate_leaves_the_callers_logging_as_it_was(capsys):
    """`submit` (and a test session) runs the estimate inside its own process: the estimate quiets the libraries'
    logging for its own report only, and puts every level back when it returns, also after an error."""
    import logging

    names = ("llama_fp8", "torchao", "torch.utils._pytree", "torch.distributed.tensor._redistribute")
    logging.getLogger("llama_fp8").setLevel(logging.INFO)
    before = {n: logging.getLogger(n).level for n in names}
    assert run_main(capsys, *TINY, "--suggest", "0")[0] == 0
    assert {n: logging.getLogger(n).level for n in names} == before
    assert run_main(capsys, *TINY, "--cp_size", "2")[0] == 2
    assert {n: logging.getLogger(n).level for n in names} == before
