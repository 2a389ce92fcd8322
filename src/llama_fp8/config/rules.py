"""What follows from what the user asked: values filled from others and cross-field rules, checked once
after parsing (``resolve``); the default run folder; the config as a plain mapping for ``config.yaml``.
What will actually run (implementation, precision, device, mesh, folders) is decided later, in
``plan.make_plan``."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from llama_fp8 import precision
from llama_fp8.config.fields import MODEL_FIELDS, ROPE_THETA_BY_TYPE, TrainConfig
from llama_fp8.errors import ConfigError


def resolve(cfg: TrainConfig) -> TrainConfig:
    """Fill the values that follow from others (still what the user asked: --model_type sets the RoPE
    base, --lr_decay_iters defaults to --max_steps, the RoPE tables cover the sequence) and check
    cross-field rules. Returns a new frozen config; idempotent."""
    if cfg.model_type is not None:
        cfg = dataclasses.replace(cfg, rope_theta=ROPE_THETA_BY_TYPE[cfg.model_type])
    missing = [n for n in MODEL_FIELDS if getattr(cfg, n) is None and n != "rope_scaling"]
    if missing:
        raise ConfigError(f"preset {cfg.model!r} does not set {', '.join(missing)}; add them to the preset or "
                          f"pass --{missing[0]}")
    if cfg.lr_decay_iters is None:
        cfg = dataclasses.replace(cfg, lr_decay_iters=cfg.max_steps)
    if cfg.max_position_embeddings < cfg.max_context_width:
        cfg = dataclasses.replace(cfg, max_position_embeddings=cfg.max_context_width)
    if cfg.hidden_width % cfg.num_heads:
        raise ConfigError(f"--hidden_width {cfg.hidden_width} is not divisible by --num_heads {cfg.num_heads}")
    if cfg.num_heads % cfg.num_key_value_heads:
        raise ConfigError(f"--num_heads {cfg.num_heads} is not divisible by --num_key_value_heads "
                          f"{cfg.num_key_value_heads} (GQA groups must be whole)")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"--min_lr {cfg.min_lr} is larger than --lr {cfg.lr}")
    if cfg.profile_steps is not None:
        from llama_fp8.telemetry import profiling

        profiling.parse_steps(cfg.profile_steps, cfg.max_steps)
        profiling.parse_ranks(cfg.profile_ranks)
    if cfg.fp8_all_gather and not cfg.fp8:
        raise ConfigError("--fp8_all_gather 1 needs --fp8 1 (it all-gathers the FP8 weights)")
    precision.check_asked(cfg)  # precision's own decision, the part the flags settle; the rest is the plan's
    return cfg


def default_run_dir() -> str:
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return os.path.join("runs", f"job_{job}")
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def asked(cfg: TrainConfig) -> dict[str, Any]:
    """The config as a plain mapping (``--config`` loads it back; the file it came from is not repeated)."""
    return {k: v for k, v in cfg.to_dict().items() if k != "config"}
