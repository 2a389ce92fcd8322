"""N-D parallelism on CPU (gloo): the mesh (dp_replicate, dp_shard, cp, tp), its validation, tensor
parallelism of the Hugging Face model in BF16 and torchao FP8 (emulated) against FSDP alone and one rank,
resharding resume across layouts, the context-parallel chunking, and every refusal."""

from __future__ import annotations

import json
import types

import pytest
import torch

from helpers import build_meta, run_cli, train_records
from llama_fp8 import config, models, parallel, precision
from llama_fp8.errors import ConfigError
from llama_fp8.parallel import ParallelDims
from llama_fp8.parallel.context import StepContext, head_tail_index

CPU = torch.device("cpu")


def env(world: int, local: int):
    return parallel.DistEnv(rank=0, local_rank=0, world_size=world, local_world_size=local, device=CPU)


# --- the mesh ---------------------------------------------------------------------------------------------
def test_mesh_dims_fill_rank_coordinates_and_groups():
    d = ParallelDims(2, -1, 16, cp=2, tp=2)
    assert (d.dp_replicate, d.dp_shard, d.dp_size) == (2, 2, 4)
    assert d.shape == (("dp_replicate", 2), ("dp_shard", 2), ("cp", 2), ("tp", 2))
    # row-major over (dp_replicate, dp_shard, cp, tp): TP neighbours, then CP, then the batch
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [d.cp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert d.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert d.groups("cp")[:2] == [[0, 2], [1, 3]]
    assert sorted(sum(d.groups("dp_shard"), [])) == list(range(16))
    assert ParallelDims(1, -1, 4, tp=2).shape == (("dp_shard", 2), ("tp", 2))
    assert ParallelDims(1, 1, 2, tp=2).shape == (("dp_shard", 1), ("tp", 2))  # FSDP over one rank: still a mesh dim
    with pytest.raises(ConfigError, match=r"--dp_replicate_size 1 x --dp_shard_size 3 x --cp_size 1 x --tp_size 2 = "
                                          r"6, but the world size is 8"):
        ParallelDims(1, 3, 8, tp=2)
    with pytest.raises(ConfigError, match="world size 8 is not divisible by 3"):
        ParallelDims(1, -1, 8, tp=3)


def test_hybrid_shards_what_tp_and_cp_leave_of_a_node(caplog):
    cfg = config.parse_args(["--model", "tiny", "--sharding_strategy", "hybrid", "--tp_size", "2"])
    d = ParallelDims.from_config(cfg, env(16, 8))
    assert (d.dp_replicate, d.dp_shard, d.tp) == (2, 4, 2)
    with pytest.raises(ConfigError, match="--tp_size 3 does not divide the 8 ranks of a node"):
        ParallelDims.from_config(config.parse_args(["--model", "tiny", "--sharding_strategy", "hybrid", "--tp_size", "3",
                                               "--tie_word_embeddings", "0"]), env(24, 8))
    caplog.set_level("WARNING")
    ParallelDims.from_config(config.parse_args(["--model", "tiny", "--tp_size", "3"]), env(6, 2))
    assert "--tp_size 3 does not divide the 2 ranks of a node" in caplog.text


@pytest.mark.parametrize("flags, message", [
    (["--tp_size", "2", "--num_key_value_heads", "1"], "--num_key_value_heads 1 is not divisible by --tp_size 2"),
    (["--tp_size", "2", "--max_context_width", "33"], "--max_context_width 33 is not divisible by --tp_size 2"),
    (["--cp_size", "2", "--max_context_width", "34"], r"not divisible by 2 x --cp_size 2 = 4"),
])
def test_shapes_the_mesh_must_divide(flags, message):
    cfg = config.parse_args(["--model", "tiny", "--tie_word_embeddings", "0", *flags])
    dims = ParallelDims.from_config(cfg, env(4, 4))
    with pytest.raises(ConfigError, match=message):
        parallel.check_shapes(cfg, dims)


# --- refusals, before anything is built -------------------------------------------------------------------
def test_what_tensor_and_context_parallelism_refuse():
    hf, te = models.get("hf"), models.get("te")
    with pytest.raises(ConfigError, match="--tp_size 2 with tied embeddings"):
        hf.check(config.parse_args(["--model", "llama3.2-1b", "--tp_size", "2"]), CPU)
    with pytest.raises(ConfigError, match="--cp_size 2 with the Hugging Face model needs CUDA"):
        hf.check(config.parse_args(["--model", "tiny", "--cp_size", "2"]), CPU)
    with pytest.raises(ConfigError, match="--cp_comm_type a2a is for the TE model"):
        hf.check(config.parse_args(["--model", "tiny", "--cp_size", "2", "--cp_comm_type", "a2a"]), torch.device("cuda", 0))
    with pytest.raises(ConfigError, match=r"--tp_size 2: --model_impl te has no tensor-parallel plan: Transformer "
                                          r"Engine's .*use --model_impl hf with --fp8_backend torchao"):
        te.check(config.parse_args(["--model", "tiny", "--tp_size", "2"]), torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="--cp_comm_type a2a spreads attention heads over the --cp_size 8"):
        te.check(config.parse_args(["--model", "tiny", "--cp_size", "8", "--cp_comm_type", "a2a"]), torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="--fp8_recipe rowwise with --tp_size 2: .*use --fp8_recipe tensorwise"):
        precision.resolve(config.parse_args(["--model", "tiny", "--fp8", "1", "--fp8_recipe", "rowwise", "--tp_size", "2"]), hf, CPU)


@pytest.mark.slow
def test_a_refused_layout_exits_2_naming_the_flag(tmp_path):
    r = run_cli(["launch", "--standalone", "--nproc_per_node=2", "-m", "llama_fp8", "train", "--model", "tiny",
                 "--device", "cpu", "--cp_size", "2", "--run_dir", str(tmp_path / "r")], timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("--cp_size 2 with the Hugging Face model needs CUDA") == 1  # agreed, reported once
    assert not (tmp_path / "r").exists()


# --- context parallelism: which tokens each rank holds ----------------------------------------------------
def test_head_tail_chunks_cover_every_position_once_as_torchs_load_balancer():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    T, cp = 16, 4
    ours = [head_tail_index(T, cp, r) for r in range(cp)]
    assert ours[0].tolist() == [0, 1, 14, 15] and ours[3].tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat(ours).tolist()) == list(range(T))
    torchs = _HeadTailLoadBalancer(T, cp, "cpu")._generate_indices().view(-1)  # all ranks' positions, in rank order
    assert torch.equal(torch.cat(ours), torchs)
    with pytest.raises(ValueError, match="cannot be cut into 2 x 4 equal chunks"):
        head_tail_index(20, 4, 0)


def test_split_step_cuts_tokens_labels_and_positions_alike():
    mesh = types.SimpleNamespace(get_local_rank=lambda: 1, size=lambda: 2)
    ctx = StepContext(cp_mesh=mesh, cp_mode="split")
    ids = torch.arange(16).view(2, 8)
    inputs = models.get("hf").model_inputs(ids)
    with ctx.step(inputs, ids + 1) as (got, labels):
        assert got["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]  # chunks 1 and 2 of 4
        assert got["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
        assert torch.equal(labels, got["input_ids"] + 1)


def test_causal_sdpa_for_context_parallelism_gives_hfs_logits():
    """The attention function the HF model uses under CP (causal SDPA, no mask, explicit GQA) computes what
    HF's own SDPA path computes."""
    from llama_fp8.models.hf.parallel import use_causal_sdpa

    cfg = config.parse_args(["--model", "tiny", "--num_layers", "2", "--num_key_value_heads", "2"])
    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    from llama_fp8.models.common import hf_config

    model = LlamaForCausalLM(hf_config(cfg)).eval()
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        want = model(**models.get("hf").model_inputs(ids)).logits
        use_causal_sdpa(model)
        got = model(**models.get("hf").model_inputs(ids)).logits
    torch.testing.assert_close(got, want)


# --- tensor parallelism: real runs -------------------------------------------------------------------------
BASE = ["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32", "--seed", "9",
        "--warmup", "0", "--tie_word_embeddings", "0", "--logging_freq", "1"]


def records(tmp_path, name: str, nproc: int, *args: str) -> list[dict]:
    run_dir = tmp_path / name
    r = run_cli(["train", *BASE, "--run_dir", str(run_dir), *args], nproc=nproc, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return train_records(run_dir)


def relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("fp8, loss_tol, norm_tol", [("0", 1e-3, 2e-2), ("1", 5e-3, 6e-2)], ids=["bf16", "fp8"])
def test_tensor_parallel_trains_like_one_rank(tmp_path, fp8, loss_tol, norm_tol):
    """5 steps, the same 4 sequences per step: 1 rank (batch 4) and FSDP 2 x TP 2 on 4 ranks (batch 2 per
    data-parallel rank). (FSDP alone against one rank: test_distributed.py's
    test_hsdp_and_fsdp_match_one_rank_with_the_same_global_batch, and its FP8 test for emulated FP8 on 2 ranks.)

    Tolerances. BF16: the layouts sum the same products in other orders (TP splits each matmul and reduces
    partial BF16 outputs), so activations differ by a few BF16 ulps (~0.4 % each); the loss, a mean over
    4 x 32 tokens x 4096 logits, averages that out: measured within 2e-4, asserted 1e-3; the gradient norm grows
    apart step by step as the updates feed back (measured 0.03, 0.005, 0.55, 0.2, 1.03 % over the 5 steps,
    deterministic on CPU), asserted 2e-2: a wrong reduction (a missing or doubled partial sum) is off by tens of %. FP8 (torchao tensorwise, emulated): each rank scales what it quantizes by that tensor's own
    amax (its own sequences; under TP with the BF16 collectives used where FP8 is emulated, the
    row-parallel layers' inputs per shard), and e4m3 rounds to 3 mantissa bits (steps of up to 6 %), so
    the runs round differently: measured within 2e-3 on the loss and 4 % on the gradient norm;
    asserted 5e-3 and 6e-2."""
    one = records(tmp_path, "one", 1, "--max_steps", "5", "--train_batch_size", "4", "--fp8", fp8)
    tp = records(tmp_path, "tp", 4, "--max_steps", "5", "--train_batch_size", "2", "--tp_size", "2", "--fp8", fp8)
    meta = json.loads((tmp_path / "tp" / "metrics.jsonl").read_text().splitlines()[0])
    assert meta["global_batch_size"] == 4 and meta["world_size"] == 4
    assert relative([r["loss"] for r in tp], [r["loss"] for r in one]) < loss_tol
    assert relative([r["grad_norm"] for r in tp], [r["grad_norm"] for r in one]) < norm_tol
    assert tp[-1]["loss"] < tp[0]["loss"]


@pytest.mark.slow
def test_resume_reshards_between_layouts(tmp_path):
    """A checkpoint saved at (dp 2, tp 2) resumes at (dp 4, tp 1) with half the batch per rank (the same
    samples, synthetic data is indexed by global sample), whose own checkpoint resumes at (dp 2, tp 2) again; the
    losses match the uninterrupted run (which saved the first checkpoint) within BF16's layout tolerance (see the
    test above). Three runs: the uninterrupted one is also the run the first resume starts from."""
    common = ["--lr_decay_iters", "6", "--checkpoint_freq", "2", "--keep_last_k", "0"]
    full = records(tmp_path, "full", 4, "--max_steps", "6", "--train_batch_size", "2", "--tp_size", "2", *common,
                   "--checkpoint_dir", str(tmp_path / "ck"))
    to_dp = records(tmp_path, "dp", 4, "--max_steps", "4", "--train_batch_size", "1", *common,
                    "--checkpoint_dir", str(tmp_path / "ck_dp"),
                    "--resume_from_checkpoint", str(tmp_path / "ck" / "step_2"))
    assert [r["step"] for r in to_dp] == [3, 4]
    assert relative([r["loss"] for r in to_dp], [r["loss"] for r in full[2:4]]) < 1e-3
    to_tp = records(tmp_path, "tp", 4, "--max_steps", "6", "--train_batch_size", "2", "--tp_size", "2", *common,
                    "--checkpoint_dir", str(tmp_path / "ck_dp"))
    assert [r["step"] for r in to_tp] == [5, 6]
    assert relative([r["loss"] for r in to_tp], [r["loss"] for r in full[4:]]) < 1e-3


def test_tp_plan_covers_every_linear_and_norm_of_the_hf_model():
    from llama_fp8.models.hf.parallel import tensor_parallel_plan

    model = build_meta(config.parse_args(["--model", "tiny", "--num_layers", "2", "--tie_word_embeddings", "0"]))
    plan = tensor_parallel_plan(model, fp8_collectives=False)
    names = {n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    names |= {n for n, m in model.named_modules() if "RMSNorm" in type(m).__name__}
    assert names <= set(plan), names - set(plan)
    assert type(plan["model.layers.1.self_attn.o_proj"]).__name__ == "RowwiseParallel"
