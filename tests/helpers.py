"""Shared test helpers: run the real CLI (one process or torchrun) and read a run's metrics.

(A module of its own: `from conftest import` is ambiguous with the conftest.py of a test folder, such as
tests/cluster/conftest.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # src/ first, then what the caller had: a node without network installs TE/torchao into a folder on it.
    paths = [str(REPO / "src"), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS", "SLURM_PROCID"):
        env.pop(k, None)
    env.update(extra)
    return env


def run_cli(args: list[str], nproc: int = 1, timeout: float = 300, module: str = "llama_fp8",
            script: str | None = None) -> subprocess.CompletedProcess:
    """`python -m llama_fp8 ARGS` in a fresh process, or under torchrun with nproc ranks."""
    target = [script] if script else ["-m", module]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *target]
    else:
        cmd = [sys.executable, *target]
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, env=cli_env(), cwd=REPO)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["type"] == "train"]


def local_text_flags(tmp_path: Path, monkeypatch) -> list[str]:
    """Train flags for real text built here: a jsonl corpus of stdlib docstrings and a 300-token BPE
    (``demo_data``); hub access off and the datasets cache in tmp_path, also for child processes."""
    import datasets

    from llama_fp8.data import demo as demo_data

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    demo = demo_data.prepare_demo_data(tmp_path / "demo", vocab_size=300, max_files=25)
    # --vocab_size 320 covers the 300-token tokenizer (checked at start-up).
    return ["--dataset", str(demo.dataset_dir), "--tokenizer", str(demo.tokenizer_dir), "--vocab_size", "320"]


def build_meta(cfg, impl: str = "hf") -> nn.Module:
    """The model of implementation ``impl`` on the meta device, as training builds it first."""
    from llama_fp8 import models

    with torch.device("meta"):
        return models.get(impl).build(cfg)


def tiny_llama_config(**overrides):
    """A tiny HF ``LlamaConfig`` for the TE mapping tests: 4 query heads sharing 2 KV heads (GQA),
    Llama 3 rope base, untied embeddings."""
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=500000.0, max_position_embeddings=64, tie_word_embeddings=False)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


# --- Transformer Engine test helpers --------------------------------------------------------------------
class FakeTransformerLayer(nn.Module):
    """Stands in for te.TransformerLayer: records kwargs, creates TE-named parameters."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw
        h, f, dev = kw["hidden_size"], kw["ffn_hidden_size"], kw["device"]
        q = kw["num_attention_heads"] * kw["kv_channels"]
        kv = kw["num_gqa_groups"] * kw["kv_channels"]
        self.self_attention = nn.Module()
        self.self_attention.layernorm_qkv = nn.Module()
        qkv = self.self_attention.layernorm_qkv
        split = [("query_weight", (q, h)), ("key_weight", (kv, h)), ("value_weight", (kv, h))]
        for name, shape in [("layer_norm_weight", (h,)),
                            *([("weight", (q + 2 * kv, h))] if kw.get("fuse_qkv_params") else split)]:
            qkv.register_parameter(name, nn.Parameter(torch.empty(shape, device=dev)))
        self.self_attention.proj = nn.Linear(q, h, bias=False, device=dev)
        self.layernorm_mlp = nn.Module()
        for name, shape in [
            ("layer_norm_weight", (h,)),
            ("fc1_weight", (2 * f, h)),
            ("fc2_weight", (h, f)),
        ]:
            self.layernorm_mlp.register_parameter(name, nn.Parameter(torch.empty(shape, device=dev)))
        self.seen_rope: list[tuple[int, ...]] = []
        self.seen_kwargs: list[dict] = []

    def forward(self, hidden_states, rotary_pos_emb, **kw):
        self.seen_rope.append(tuple(rotary_pos_emb.shape))
        self.seen_kwargs.append({"hidden_shape": tuple(hidden_states.shape), **kw})  # e.g. THD cu_seqlens
        return self.self_attention.proj(hidden_states)  # any (..., H) -> (..., H) map will do


@torch.no_grad()
def init_te_weights(model: nn.Module, std: float) -> None:
    """HF-style init for tests that build TE layers directly: norm weights 1, every other weight N(0, std)
    (works on FSDP2 DTensor parameters: in-place random ops are DTensor-aware). TE modules whose primary
    weights are FP8 are reset by TE itself, which quantizes each local shard."""
    fp8_owned: set[int] = set()
    for module in model.modules():
        if getattr(module, "primary_weights_in_fp8", False):
            module.reset_parameters()
            fp8_owned.update(id(p) for p in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        if id(param) in fp8_owned:
            continue
        if name.endswith(("layer_norm_weight", "norm.weight")):
            param.fill_(1.0)
        else:
            param.normal_(mean=0.0, std=std)


def build_te_sharded(cfg, env) -> nn.Module:
    """Our build path for the real TE model on CPU, up to the init (meta -> parallelize -> to_empty -> init).
    TE refuses to construct modules without a GPU, so ``torch.cuda.is_available`` is patched around
    construction only; nothing runs on CUDA."""
    from unittest import mock

    from llama_fp8 import models, parallel

    impl = models.get("te")
    with mock.patch.object(torch.cuda, "is_available", return_value=True), torch.device("meta"):
        model = impl.build(cfg)
    mesh = parallel.build_mesh(parallel.ParallelDims.from_config(cfg, env), env)
    parallel.parallelize(model, impl, mesh, cfg)
    model.to_empty(device="cpu")
    impl.init_weights(model, cfg, torch.device("cpu"))
    return model


def worker_pids(parent: int) -> dict[int, int]:
    """{rank: pid} of torchrun's workers, read from /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != parent:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(d.name)
    return out


def wait_for(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
