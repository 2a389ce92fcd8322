"""The model-implementation registry: the interface is enough to add an implementation, and nothing outside
``models/`` needs to know its name."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from helpers import REPO, read_metrics, run_cli
from llama_fp8 import config, models


def test_builtin_order_and_auto():
    assert models.names() == ("te", "hf")  # auto tries TE first
    assert models.resolve("auto", torch.device("cpu")).name == "hf"  # TE never on CPU
    with pytest.raises(config.ConfigError, match="--model_impl 'nope' is not valid; valid: auto, te, hf"):
        models.get("nope")


def test_a_registered_implementation_reaches_the_parser_and_help(registry):
    from toy_impl import ToyImpl

    registry.register(ToyImpl())
    cfg = config.parse_args(["--model", "tiny", "--model_impl", "toy"])
    assert cfg.model_impl == "toy"
    assert "toy (a toy residual MLP LM (tests only))" in " ".join(config.build_parser().format_help().split())
    assert models.resolve("auto", torch.device("cpu")).name == "hf"  # never picked by auto
    with pytest.raises(config.ConfigError, match="--fp8 1: --model_impl toy has no FP8 backend"):
        from llama_fp8 import precision

        precision.resolve(config.parse_args(["--model", "tiny", "--fp8", "1"]), ToyImpl(), torch.device("cpu"))


@pytest.mark.slow
def test_a_third_implementation_trains_through_the_real_loop_on_two_ranks(tmp_path):
    """ToyImpl is defined in tests/models/toy_impl.py only; on 2 gloo ranks it trains 4 steps through the real
    plan -> build -> FSDP2 -> loop -> checkpoint path, and a rerun resumes from its checkpoint."""
    out = tmp_path / "out"
    out.mkdir()
    args = [str(out), "--model", "tiny", "--model_impl", "toy", "--device", "cpu", "--num_layers", "2",
            "--max_context_width", "16", "--run_dir", str(tmp_path / "run"), "--checkpoint_freq", "2",
            "--lr", "1e-2", "--warmup", "0"]
    r = run_cli([*args, "--max_steps", "2"], nproc=2, script=str(REPO / "tests" / "models" / "toy_impl.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli([*args, "--max_steps", "4"], nproc=2, script=str(REPO / "tests" / "models" / "toy_impl.py"))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    cfg = config.parse_args(["--model", "tiny", "--num_layers", "2"])
    full = cfg.vocab_size * cfg.hidden_width * 2 + 2 * (cfg.hidden_width ** 2 + cfg.hidden_width)
    assert ranks[0]["num_params"] == full and ranks[0]["start_step"] == 2  # the rerun resumed
    assert ranks[0]["local_numel"] + ranks[1]["local_numel"] == full  # FSDP2 sharded it over both ranks
    assert 0 < ranks[0]["local_numel"] < full
    resolved = yaml.safe_load((tmp_path / "run" / "config.resume_step_2.yaml").read_text())["resolved"]
    assert resolved["model_impl"] == "toy" and resolved["dims"]["dp_shard"] == 2
    losses = [rec["loss"] for rec in read_metrics(tmp_path / "run") if rec["type"] == "train"]
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_what_an_implementation_lacks_is_refused_in_one_place_with_its_reason():
    """``ModelImpl.check`` alone refuses a parallelism or an activation checkpointing an implementation lacks; the
    implementation only says why (``why_not``), and the refusal names the flag, the reason and what is valid."""
    from llama_fp8.models.spec import ModelImpl

    te, cuda = models.get("te"), torch.device("cuda", 0)  # refused before TE's own checks (CUDA, the library)
    with pytest.raises(config.ConfigError) as e:
        te.check(config.parse_args(["--model", "tiny", "--activation_checkpointing", "selective"]), cuda)
    assert str(e.value) == ("--activation_checkpointing selective does not work with --model_impl te: the TE model "
                            "checkpoints whole blocks with TE's checkpoint; valid with it: none, full")
    with pytest.raises(config.ConfigError, match=r"^--tp_size 2: --model_impl te has no tensor-parallel plan: "
                                                 r"Transformer Engine's tensor parallelism .* or --tp_size 1$"):
        te.check(config.parse_args(["--model", "tiny", "--tp_size", "2"]), cuda)

    class Bare(ModelImpl):
        name, activation_checkpointing_modes = "bare", ()

    with pytest.raises(config.ConfigError, match="^--activation_checkpointing full does not work with --model_impl "
                                                 "bare; valid with it: none$"):
        Bare().check(config.parse_args(["--model", "tiny", "--activation_checkpointing", "1"]), cuda)
    with pytest.raises(config.ConfigError, match="^--cp_size 2: --model_impl bare has no context parallelism$"):
        Bare().check(config.parse_args(["--model", "tiny", "--cp_size", "2"]), cuda)
