"""The loop in one process: schedule, optimizer groups, log line, metrics.jsonl, and each flag's effect."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from helpers import build_meta, read_metrics, train_records
from llama_fp8 import config as C
from llama_fp8 import train as T
from llama_fp8.parallel import DistEnv
from llama_fp8.telemetry import metrics, peaks
from llama_fp8.train import build as B
from llama_fp8.train import loop as L
from llama_fp8.train import state as S

CPU_ENV = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


def cfg_for(*args: str) -> C.TrainConfig:
    return C.parse_args(["--model", "tiny", *args])


def run(tiny_args: list[str], *extra: str) -> tuple[int, Path]:
    cfg = C.parse_args([*tiny_args, *extra])
    return T.run(cfg), Path(cfg.run_dir)


# --- schedule and optimizer ----------------------------------------------------------------------
def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = cfg_for("--lr", "1e-3", "--min_lr", "1e-4", "--max_steps", "100", "--warmup", "0.1")
    lrs = [B.lr_at(s, cfg) for s in range(120)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)      # linear warmup over 10 steps
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[55] == pytest.approx(1e-4 + 0.5 * 9e-4)                          # half-way through the decay
    assert lrs[100] == pytest.approx(1e-4) and lrs[119] == pytest.approx(1e-4)  # min_lr after decay
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_lr_decay_styles_and_iters():
    lin = cfg_for("--lr", "1e-3", "--min_lr", "0", "--warmup", "0", "--lr_decay_style", "linear",
                  "--max_steps", "50", "--lr_decay_iters", "20")
    assert B.lr_at(10, lin) == pytest.approx(5e-4) and B.lr_at(20, lin) == 0.0 and B.lr_at(40, lin) == 0.0
    const = cfg_for("--lr", "1e-3", "--warmup", "0", "--lr_decay_style", "constant")
    assert {B.lr_at(s, const) for s in range(30)} == {1e-3}


def test_optimizer_groups_betas_and_weight_decay():
    cfg = cfg_for("--weight_decay", "0.05", "--beta1", "0.8", "--beta2", "0.9")
    model = build_meta(cfg).to_empty(device="cpu")
    opt = B.build_optimizer(model, cfg, torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.9)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all("norm" in names[id(p)] or "embed_tokens" in names[id(p)] for p in no_decay["params"])
    assert any("embed_tokens" in names[id(p)] for p in no_decay["params"])
    assert len(decay["params"]) == cfg.num_layers * 7 + 1   # 7 matrices per layer + lm_head


# --- whole runs ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_run_writes_config_metrics_and_log_line(tiny_args, capsys):
    rc, run_dir = run(tiny_args, "--max_steps", "6", "--logging_freq", "2")
    assert rc == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("Batch ")]
    assert len(lines) == 3
    import re
    pat = (r"^Batch (\d+) Loss: \d+\.\d{5}, Speed: \d+\.\d{2} samples/sec, lr: \d\.\d{6}, "
           r"tokens/s/device: [\d.]+, TFLOPS/device: [\d.]+, MFU\(bf16 peak\): n/a, mem: [\d.]+ GiB")
    assert [int(re.match(pat, ln).group(1)) for ln in lines] == [2, 4, 6]
    assert f"Training finished: 6 steps, run dir {run_dir}" in out
    recs = read_metrics(run_dir)
    assert recs[0]["type"] == "meta" and recs[0]["precision"] == "bf16" and recs[0]["num_params"] > 0
    train = [r for r in recs if r["type"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]
    for key in ("loss", "lr", "grad_norm", "samples_per_sec", "tokens_per_sec_per_device", "tflops_per_device",
                "mem_peak_gib", "data_wait_frac"):
        assert isinstance(train[-1][key], float), key
    assert train[-1]["mfu_vs_bf16_peak"] is None                 # CPU: no invented MFU
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())  # what was asked, and what ran
    assert saved["asked"]["max_steps"] == 6 and saved["asked"]["num_layers"] == 2
    assert saved["asked"]["model_impl"] == "auto" and saved["resolved"]["model_impl"] == "hf"
    assert saved["resolved"]["run_dir"] == str(run_dir) and saved["resolved"]["global_batch"] == 2
    assert C.load_yaml(str(run_dir / "config.yaml")) == C.asked(C.parse_args([*tiny_args, "--max_steps", "6",
                                                                               "--logging_freq", "2"]))


def test_existing_run_dir_is_not_overwritten(tiny_args):
    rc, run_dir = run(tiny_args, "--max_steps", "1")
    before = (run_dir / "metrics.jsonl").read_bytes()
    rc2, _ = run(tiny_args, "--max_steps", "1")
    assert rc2 == 2 and (run_dir / "metrics.jsonl").read_bytes() == before


@pytest.mark.slow
def test_same_seed_same_losses_other_seed_differs(tmp_path, tiny_args):
    base = [a for a in tiny_args if not a.startswith(str(tmp_path))][:-1]
    losses = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        rc, d = run(base, "--run_dir", str(tmp_path / name), "--max_steps", "3", "--seed", seed)
        losses.append([r["loss"] for r in train_records(d)])
    assert losses[0] == losses[1] and losses[0] != losses[2]


def test_bf16_flag_sets_compute_dtype(tiny_args, monkeypatch):
    from llama_fp8.parallel import loss

    seen = []
    real = loss.output_cross_entropy
    monkeypatch.setattr(loss, "output_cross_entropy",
                        lambda hidden, weight, labels: (seen.append(weight.dtype), real(hidden, weight, labels))[1])
    run(tiny_args, "--max_steps", "1", "--bf16", "1")
    run([*tiny_args[:-1], tiny_args[-1] + "32"], "--max_steps", "1", "--bf16", "0")
    assert seen == [torch.bfloat16, torch.float32]


def test_fp8_run_is_labelled_and_uses_float8(tiny_args, monkeypatch):
    rc, d = run(tiny_args, "--max_steps", "2", "--fp8", "1", "--fp8_recipe", "rowwise")
    meta = read_metrics(d)[0]
    assert rc == 0 and meta["precision"] == "fp8-torchao-rowwise" and meta["fp8_emulated"] is True
    resolved = yaml.safe_load((d / "config.yaml").read_text())["resolved"]["precision"]
    assert resolved == {"name": "fp8-torchao-rowwise", "backend": "torchao", "recipe": "rowwise", "emulated": True,
                        "all_gather": False, "exclude": [], "verify": "error", "stats_every": 0, "format": "fp8",
                        "reason": "backend torchao: the first of --model_impl hf; recipe rowwise: asked (--fp8_recipe)",
                        "bf16_tail": "", "notes": []}


def test_grad_clip_limits_the_update(tmp_path, tiny_args):
    """AdamW normalizes updates, so only a clip far below the gradient norm shows: tiny steps."""
    base = tiny_args[:-1]

    def first_step_delta(clip: str) -> float:
        cfg = C.parse_args([*base, str(tmp_path / f"clip{clip}"), "--max_steps", "1", "--grad_clip", clip,
                            "--warmup", "0"])
        s = S.start(cfg, CPU_ENV_INIT())
        try:
            before = s.model.model.layers[0].mlp.up_proj.weight.detach().to_local().clone()
            L.train_step(s, iter([next(iter(s.train_loader))]), 1)
            return (s.model.model.layers[0].mlp.up_proj.weight.detach().to_local() - before).abs().mean().item()
        finally:
            s.close()

    try:
        free, clipped = first_step_delta("0"), first_step_delta("1e-9")
    finally:
        torch.distributed.destroy_process_group()
    assert clipped < 0.1 * free


def CPU_ENV_INIT() -> DistEnv:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return CPU_ENV


def test_batch_size_and_context_width_set_the_batch(tiny_args):
    cfg = C.parse_args([*tiny_args, "--train_batch_size", "3", "--max_context_width", "16"])
    batch = next(iter(B.build_loaders(cfg, CPU_ENV)[0]))
    assert batch["input_ids"].shape == (3, 16) and batch["labels"].shape == (3, 16)


def test_max_steps_and_logging_freq(tiny_args):
    rc, d = run(tiny_args, "--max_steps", "5", "--logging_freq", "2")
    assert [r["step"] for r in train_records(d)] == [2, 4, 5]   # the last step is always logged


@pytest.mark.slow
def test_validation_flags(tiny_args, capsys):
    rc, d = run(tiny_args, "--max_steps", "4", "--validation_freq", "2", "--validation_batches", "3",
                "--val_batch_size", "1")
    vals = [r for r in read_metrics(d) if r["type"] == "val"]
    assert [v["step"] for v in vals] == [2, 4]
    assert all(v["val_ppl"] == pytest.approx(math.exp(v["val_loss"])) for v in vals)
    assert "Validation loss at step 2:" in capsys.readouterr().out


def test_peak_tflops_gives_mfu(tiny_args):
    """--peak_tflops on CPU: a BF16 run's MFU against it. (FP8 here is emulated, whose MFU is left blank:
    tests/test_peaks.py shows both, the FP8 peak's MFU of a non-emulated meter too.)"""
    rc, d = run(tiny_args, "--max_steps", "2", "--peak_tflops", "0.5", "--fp8", "0")
    meta, *rest = read_metrics(d)
    last = [r for r in rest if r["type"] == "train"][-1]
    assert meta["peak_tflops_bf16"] == 0.5 and meta["peak_tflops_fp8"] == 1.0
    assert last["mfu_vs_bf16_peak"] == pytest.approx(last["tflops_per_device"] / 0.5)
    assert last["mfu_vs_fp8_peak"] is None  # a BF16 run


def test_device_cuda_without_gpu_is_a_config_error(tiny_args):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rc, _ = run(tiny_args, "--device", "cuda")
    assert rc == 2


def test_peak_table_matches_exact_skus():
    names = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 NVL": 835.5, "NVIDIA H100 PCIe": 756.0,
             "NVIDIA GB200": 2500.0, "NVIDIA B200": 2250.0, "NVIDIA L40S": 362.05, "NVIDIA L4": 121.0}
    for name, bf16 in names.items():
        assert peaks.resolve(name, None)[0] == bf16, name  # more SKUs in tests/test_peaks.py
    assert metrics.peak_tflops(torch.device("cpu")) == ("cpu", None, None)


def test_log_line_prefix_is_what_monitors_match():
    rec = {"step": 20, "loss": 8.421843, "samples_per_sec": 47.0612, "lr": 1e-4, "tokens_per_sec_per_device": 1.0,
           "tflops_per_device": 0.1, "mfu_vs_bf16_peak": 0.41, "mfu_vs_fp8_peak": None, "mem_peak_gib": 1.0,
           "grad_norm": None}
    assert metrics.format_line(rec).startswith("Batch 20 Loss: 8.42184, Speed: 47.06 samples/sec, lr: 0.000100, ")
    assert "MFU(bf16 peak): 0.410" in metrics.format_line(rec)
    json.dumps(rec)


@pytest.mark.slow
def test_val_batch_size_sets_the_validation_batch(tiny_args):
    cfg = C.parse_args([*tiny_args, "--validation_freq", "1", "--val_batch_size", "3", "--validation_batches", "2"])
    _, val = B.build_loaders(cfg, CPU_ENV)
    batches = list(val)
    assert len(batches) == 2 and batches[0]["input_ids"].shape == (3, cfg.max_context_width)
