"""The model-implementation registry: the interface is enough to add an implementation, and nothing outside
``models/`` needs to know its name."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from helpers import REPO, read_metrics, run_cli
from llama_fp8 import config as C
from llama_fp8 import models


def test_builtin_order_and_auto():
    assert models.names() == ("te", "hf")  # auto tries TE first
    assert models.resolve("auto", torch.device("cpu")).name == "hf"  # TE never on CPU
    with pytest.raises(C.ConfigError, match="--model_impl 'nope' is not valid; valid: auto, te, hf"):
        models.get("nope")


def test_a_registered_implementation_reaches_the_parser_and_help(registry):
    from toy_impl import ToyImpl

    registry.register(ToyImpl())
    cfg = C.parse_args(["--model", "tiny", "--model_impl", "toy"])
    assert cfg.model_impl == "toy"
    assert "toy (a toy residual MLP LM (tests only))" in " ".join(C.build_parser().format_help().split())
    assert models.resolve("auto", torch.device("cpu")).name == "hf"  # never picked by auto
    with pytest.raises(C.ConfigError, match="--fp8 1: --model_impl toy has no FP8 backend"):
        from llama_fp8 import precision

        precision.resolve(C.parse_args(["--model", "tiny", "--fp8", "1"]), ToyImpl(), torch.device("cpu"))


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
    cfg = C.parse_args(["--model", "tiny", "--num_layers", "2"])
    full = cfg.vocab_size * cfg.hidden_width * 2 + 2 * (cfg.hidden_width ** 2 + cfg.hidden_width)
    assert ranks[0]["num_params"] == full and ranks[0]["start_step"] == 2  # the rerun resumed
    assert ranks[0]["local_numel"] + ranks[1]["local_numel"] == full  # FSDP2 sharded it over both ranks
    assert 0 < ranks[0]["local_numel"] < full
    resolved = yaml.safe_load((tmp_path / "run" / "config.resume_step_2.yaml").read_text())["resolved"]
    assert resolved["model_impl"] == "toy" and resolved["dims"]["dp_shard"] == 2
    losses = [rec["loss"] for rec in read_metrics(tmp_path / "run") if rec["type"] == "train"]
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]
