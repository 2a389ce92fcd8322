"""GPU self-tests of the Transformer Engine path (`pytest -m gpu tests`), skipped without CUDA.

Not run in this project's CI (no GPU): these are the first thing to run on a new cluster.
Tolerances, and why:
- TE vs HF logits, same weights: BF16 ``atol = rtol = 2e-2`` (BF16 keeps 8 bits of mantissa,
  ~4e-3 relative; TE uses fused attention and applies RoPE with FP32 frequencies where HF rounds
  cos/sin to BF16, so a few ULPs differ per layer); FP32 ``atol = rtol = 1e-3``, compared with TF32 off:
  TE runs an all-FP32 GEMM with cuBLASLt's ``CUBLAS_COMPUTE_32F_FAST_TF32`` (common/gemm/cublaslt_gemm.cu)
  where torch's FP32 matmul does not use TF32 by default, and TF32's 10-bit mantissa (~5e-4 relative per
  input rounding) makes 1e-3 marginal. The FP32 case runs in a child process with ``NVIDIA_TF32_OVERRIDE=0``
  (read by the NVIDIA libraries when they load, so it cannot be set inside a running test).
- 50 FP8 steps vs 50 BF16 steps of the tiny model (same data, init and seed): the mean loss of the
  last 10 steps differs by at most 5% of BF16's, and both runs' losses go down.
- FP8 primary weights (FP32 masters) vs BF16 weights, 100 steps: within twice the gap between two seeds of
  the BF16-weight run, or 1 % of its loss when that gap is smaller.
- FP8 all-gather bytes: measured after one step from what FSDP2 packs for the collective (``gather_bytes``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LOGITS_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-3}
LOSS_REL_TOL = 0.05


@pytest.fixture(scope="module")
def te():
    from llama_fp8.models.te.fp8 import recipes as te_recipes

    try:
        return te_recipes.te_import()
    except ImportError as e:
        pytest.skip(str(e))


def small_config(**kw):
    from transformers import LlamaConfig

    base = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_theta=500000.0,
        max_position_embeddings=256,
    )
    return LlamaConfig(**{**base, **kw})


def build_pair(tmp_path: Path, dtype: torch.dtype, **cfg_kw):
    """HF Llama and our TE Llama with the same weights (through a save_pretrained checkpoint)."""
    from transformers import LlamaForCausalLM

    from llama_fp8.models.te import model as te_llama
    from llama_fp8.models.te.weights import load_hf_checkpoint_into_te

    cfg = small_config(**cfg_kw)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    hf.save_pretrained(tmp_path, max_shard_size="1MB")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # TE's params_dtype defaults to the default dtype
    try:
        with torch.device("cuda"):
            model = te_llama.build_te_llama(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    load_hf_checkpoint_into_te(model.state_dict(), tmp_path)
    return hf, model


def passed_without_tf32(request) -> bool:
    """Whether this test already ran with TF32 off in every NVIDIA library: if not, run it again in a child with
    ``NVIDIA_TF32_OVERRIDE=0`` and assert that child passed."""
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return False
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=request.config.rootpath,
                          env={**os.environ, "NVIDIA_TF32_OVERRIDE": "0"})
    assert proc.returncode == 0, f"{' '.join(cmd)} with NVIDIA_TF32_OVERRIDE=0:\n{proc.stdout[-3000:]}"
    return True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scaling", [None, "llama3"])
def test_te_logits_match_hf(te, tmp_path, dtype, scaling, request):
    if dtype == torch.float32 and passed_without_tf32(request):
        return
    rope = None
    if scaling:
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    hf, model = build_pair(tmp_path, dtype, rope_scaling=rope)
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = model(ids).logits
    tol = LOGITS_TOL[dtype]
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8", "block"])
def test_fp8_forward_backward_is_finite(te, tmp_path, recipe):
    from llama_fp8.models.te.fp8 import recipes as te_recipes

    cap = torch.cuda.get_device_capability()
    try:
        te_recipes.check_recipe_supported(recipe, cap, torch.version.cuda, te_recipes.te_version())
    except ValueError as e:
        pytest.skip(str(e))
    _, model = build_pair(tmp_path, torch.bfloat16)
    model.train()
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    with te_recipes.autocast(True, te_recipes.make_recipe(recipe), None):
        out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def run_train(run_dir: Path, *args: str, nproc: int = 1) -> list[dict]:
    """`llama-fp8 train` (under `llama-fp8 launch` with nproc ranks) on the TE model; its metrics records."""
    cmd = [sys.executable, "-m", "llama_fp8", "launch", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "llama_fp8", "train", "--model", "tiny", "--model_impl", "te", "--logging_freq", "1", "--seed", "0",
           "--dataset", "synthetic", "--device", "cuda", "--run_dir", str(run_dir), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), timeout=1800)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(run_dir: Path, fp8: int) -> list[float]:
    records = run_train(run_dir, "--fp8", str(fp8), "--max_steps", "50")
    meta = records[0]
    assert meta["type"] == "meta" and meta["model_impl"] == "te"
    assert meta["precision"].startswith("fp8-te-") == bool(fp8), meta["precision"]
    return [r["loss"] for r in records if r["type"] == "train"]


def test_fp8_loss_tracks_bf16_for_50_steps(te, tmp_path):
    bf16 = _train(tmp_path / "bf16", fp8=0)
    fp8 = _train(tmp_path / "fp8", fp8=1)
    assert len(bf16) == len(fp8) == 50
    tail_bf16, tail_fp8 = sum(bf16[-10:]) / 10, sum(fp8[-10:]) / 10
    assert bf16[-1] < bf16[0] and fp8[-1] < fp8[0], (bf16[:3], fp8[:3])
    assert abs(tail_fp8 - tail_bf16) <= LOSS_REL_TOL * tail_bf16, (tail_fp8, tail_bf16)


def _late_error(got: torch.Tensor, want: torch.Tensor, start: int) -> float:
    """Relative L2 error of the logits at positions >= start."""
    a, b = got[:, start:].float(), want[:, start:].float()
    return ((a - b).norm() / b.norm()).item()


def test_te_logits_match_hf_at_4096_tokens_through_the_build_path(te, tmp_path):
    """TE vs HF logits at 4096 tokens, both built as training builds them (plan -> meta -> fully_shard with
    BF16 parameters -> to_empty -> --init_from_hf from one save_pretrained checkpoint), Llama 3.1's RoPE
    (theta 500000, llama3 scaling) on a 2-layer model.

    Tolerance: both compute in BF16 (8 significant bits, ~4e-3 relative per rounding); TE fuses attention,
    RMSNorm and RoPE (with FP32 angles) where HF rounds cos/sin to BF16, so a few ULPs differ per op; over
    2 layers the relative L2 error of the logits stays well under 3e-2, at late positions as at early ones.
    The control: the same TE model fed angles rounded to BF16 (the bug this guards against) must be far off
    at positions >= 2048, where BF16 rounds angles to multiples of 16 rad."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from llama_fp8 import config as C
    from llama_fp8 import parallel
    from llama_fp8.models.common import hf_config
    from llama_fp8.train import state

    shape = ["--model", "llama3.1-8b", "--num_layers", "2", "--hidden_width", "512", "--num_heads", "4",
             "--num_key_value_heads", "2", "--intermediate_size", "1024", "--vocab_size", "1024",
             "--max_context_width", "4096", "--device", "cuda"]
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config(C.parse_args(shape))).save_pretrained(tmp_path / "hf", max_shard_size="5MB")
    ids = torch.randint(0, 1024, (1, 4096), device="cuda")
    logits = {}
    for impl in ("hf", "te"):
        cfg = C.parse_args([*shape, "--model_impl", impl, "--init_from_hf", str(tmp_path / "hf"),
                            "--run_dir", str(tmp_path / impl)])
        env = parallel.init_distributed(cfg)
        try:
            model = state.plan_and_build_model(cfg, env)[3].eval()
            with torch.no_grad():
                logits[impl] = model(input_ids=ids).logits
                if impl == "te":
                    for layer in model.model.layers:
                        layer.te_layer.register_forward_pre_hook(
                            lambda m, a, kw: (a, {**kw, "rotary_pos_emb": kw["rotary_pos_emb"].bfloat16().float()}),
                            with_kwargs=True)
                    logits["te_bf16_angles"] = model(input_ids=ids).logits
        finally:
            dist.destroy_process_group()
    err_all, err_late = _late_error(logits["te"], logits["hf"], 0), _late_error(logits["te"], logits["hf"], 2048)
    control = _late_error(logits["te_bf16_angles"], logits["hf"], 2048)
    assert err_all < 3e-2 and err_late < 3e-2, (err_all, err_late)
    assert control > 3e-2 and control > 3 * err_late, (control, err_late)


def _losses(records: list[dict], after: int = 0) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["type"] == "train" and r["step"] > after}


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_te_fp8_resume_matches_the_uninterrupted_run(te, tmp_path, recipe):
    """10 steps, save, resume for 10 more under each TE recipe: the resumed losses match an uninterrupted
    20-step run within FP8's run-to-run noise, measured here by running the uninterrupted run twice (at
    least 1e-3 relative). For delayed scaling this needs the scales and amax histories restored."""
    from llama_fp8.models.te.fp8 import recipes as te_recipes

    try:
        te_recipes.check_recipe_supported(recipe, torch.cuda.get_device_capability(), torch.version.cuda,
                                          te_recipes.te_version())
    except ValueError as e:
        pytest.skip(str(e))
    _check_resume(tmp_path, ["--fp8", "1", "--fp8_recipe", recipe, "--lr_decay_iters", "20", "--checkpoint_freq",
                             "10"])


def test_te_fp8_weights_resume_matches_the_uninterrupted_run(te, tmp_path):
    """The same with FP8 primary weights (--fp8_all_gather 1): the optimizer's FP32 masters and moments are saved
    and restored with the FP8 weights (MasterAdamW's state under each parameter's name)."""
    _check_resume(tmp_path, ["--fp8", "1", "--fp8_recipe", "current", "--fp8_all_gather", "1", "--lr_decay_iters",
                             "20", "--checkpoint_freq", "10"])


def _check_resume(tmp_path: Path, args: list[str]) -> None:
    a = _losses(run_train(tmp_path / "a", *args, "--max_steps", "20"), after=10)
    b = _losses(run_train(tmp_path / "b", *args, "--max_steps", "20"), after=10)
    noise = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    run_train(tmp_path / "r", *args, "--max_steps", "10")
    resumed = _losses(run_train(tmp_path / "r", *args, "--max_steps", "20"), after=10)
    assert sorted(resumed) == list(range(11, 21))
    worst = max(abs(resumed[s] - a[s]) / abs(a[s]) for s in a)
    assert worst <= max(2 * noise, 1e-3), (worst, noise)


def test_te_fp8_all_gather_halves_the_bytes_and_tracks_bf16_all_gather(te, tmp_path, gather_bytes):
    """--fp8_all_gather 1 with the TE model: the blocks' weights are FP8 (built under quantized_model_init, fused
    QKV, materialized by TE's reset_parameters with our init). Measured after one training step (FSDP2's lazy init
    sets param_dtype and re-reads the Parameters TE's reset_parameters swapped), from the tensors FSDP2 packs into
    the all-gather (``gather_bytes``): the blocks send at most ~half the bytes of the BF16 all-gather (norm
    weights stay BF16); and 20 steps track the BF16-all-gather FP8 run within 2 %."""
    import torch.distributed as dist

    from llama_fp8 import config as C
    from llama_fp8 import parallel
    from llama_fp8.models.common import hf_config
    from llama_fp8.train import build, state

    sizes = {}
    for ag in ("0", "1"):
        cfg = C.parse_args(["--model", "tiny", "--model_impl", "te", "--device", "cuda", "--fp8", "1",
                            "--fp8_all_gather", ag, "--run_dir", str(tmp_path / f"build{ag}")])
        env = parallel.init_distributed(cfg)
        try:
            _, _, prec, model, _, _ = state.plan_and_build_model(cfg, env)
            optimizer = build.build_optimizer(model, cfg, env.device, prec)
            ids = torch.randint(0, hf_config(cfg).vocab_size, (2, 128), device="cuda")
            with prec.autocast():
                logits = model(input_ids=ids).logits
            logits.float().pow(2).mean().backward()
            optimizer.step()
            sizes[ag] = sum(gather_bytes(layer) for layer in model.model.layers)
        finally:
            dist.destroy_process_group()
    assert sizes["1"] <= 0.52 * sizes["0"], sizes
    bf16_gather = [r["loss"] for r in run_train(tmp_path / "a", "--fp8", "1", "--max_steps", "20") if r["type"] == "train"]
    fp8_gather = [r["loss"] for r in run_train(tmp_path / "b", "--fp8", "1", "--fp8_all_gather", "1", "--max_steps", "20")
                  if r["type"] == "train"]
    assert fp8_gather[-1] == pytest.approx(bf16_gather[-1], rel=0.02)


def _tail_loss(run_dir: Path, *args: str) -> float:
    losses = [r["loss"] for r in run_train(run_dir, "--fp8", "1", "--max_steps", "100", *args) if r["type"] == "train"]
    assert len(losses) == 100 and losses[-1] < losses[0], losses[:3]
    return sum(losses[-10:]) / 10


def test_te_fp8_weights_track_bf16_weights_for_100_steps(te, tmp_path):
    """FP8 primary weights (--fp8_all_gather 1: FP32 masters in the optimizer) vs TE FP8 with BF16 weights, 100
    steps at the preset learning rate: the mean loss of the last 10 steps differs by no more than the run-to-run
    noise, measured here as the gap between two seeds of the BF16-weight run (doubled), or 1 % of the loss when
    that gap is smaller. Without masters, small updates are rounded away and the FP8-weight run falls behind."""
    reference = _tail_loss(tmp_path / "bf16w")
    noise = abs(_tail_loss(tmp_path / "bf16w_seed1", "--seed", "1") - reference)
    fp8_weights = _tail_loss(tmp_path / "fp8w", "--fp8_all_gather", "1")
    assert abs(fp8_weights - reference) <= max(2 * noise, 0.01 * reference), (fp8_weights, reference, noise)


def test_te_fp8_weights_start_masters_from_the_bf16_init_and_keep_excluded_layers_high_precision(te, tmp_path):
    """--fp8_all_gather 1 under delayed scaling (the init is quantized at scale 1.0) with --fp8_exclude
    model.layers.0.*: the excluded block's weights are plain high-precision tensors (not TE QuantizedTensors: they
    all-gather in BF16), the other block's are FP8; each FP8 weight's FP32 master starts from exactly the weights the
    BF16 run starts from, not from their FP8 quantization."""
    import torch.distributed as dist

    from llama_fp8 import config as C
    from llama_fp8 import parallel
    from llama_fp8.models.te.fp8.master_weights import is_quantized, local
    from llama_fp8.train import build, state

    base = ["--model", "tiny", "--model_impl", "te", "--device", "cuda", "--num_layers", "2", "--seed", "3"]
    built = {}
    for name, extra in (("fp8w", ["--fp8", "1", "--fp8_recipe", "delayed", "--fp8_all_gather", "1",
                                  "--fp8_exclude", "model.layers.0.*"]), ("bf16", ["--fp8", "0"])):
        cfg = C.parse_args([*base, *extra, "--run_dir", str(tmp_path / name)])
        env = parallel.init_distributed(cfg)
        try:
            _, _, prec, model, _, _ = state.plan_and_build_model(cfg, env)
            optimizer = build.build_optimizer(model, cfg, env.device, prec)
            assert all(g["fused"] for g in optimizer.param_groups)  # MasterAdamW or torch's, fused alike
            weights = {n: p for n, p in model.named_parameters() if p.dim() == 2 and ".te_layer." in n}
            masters = {n: optimizer._init_state(p)["master"].full_tensor() for n, p in weights.items()
                       if is_quantized(p)}
            built[name] = ({n: is_quantized(p) for n, p in weights.items()}, masters,
                           {n: p.full_tensor().float() if not is_quantized(p) else None for n, p in weights.items()})
            assert all(is_quantized(p) or local(p).dtype == torch.float32 for p in weights.values())
        finally:
            dist.destroy_process_group()
    quantized, masters, _ = built["fp8w"]
    _, _, bf16 = built["bf16"]
    assert quantized and all(q == (not n.startswith("model.layers.0.")) for n, q in quantized.items()), quantized
    assert masters and set(masters) == {n for n, q in quantized.items() if q}
    for n, master in masters.items():
        assert torch.equal(master, bf16[n]), n
