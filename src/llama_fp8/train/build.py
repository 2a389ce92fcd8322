"""What a run is built from, in the fixed order: the model (meta -> FP8 convert -> parallelize ->
to_empty -> init or load -> value check), the optimizer and its LR schedule, and the data loaders."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from llama_fp8 import parallel
from llama_fp8.config import TrainConfig
from llama_fp8.errors import ConfigError
from llama_fp8.models.common import ModelSize, model_size

log = logging.getLogger("llama_fp8.train")


def build_model(cfg: TrainConfig, env: parallel.DistEnv, plan, impl, prec
                ) -> tuple[nn.Module, ModelSize, parallel.StepContext]:
    """Each rank only ever materializes its own shard: the model is built on meta, converted, parallelized,
    then ``materialize`` allocates the local shards, which are initialized (or loaded) in place. Also returns
    what every step runs inside (loss parallelism, context parallelism)."""
    model, size, context, mesh = build_sharded(cfg, env, plan, impl, prec)
    materialize(model, cfg, env, impl, resuming=bool(getattr(plan, "resume_from", None)))
    prec.prepare(model)  # e.g. FP8 state that a checkpoint may be loaded into
    log.info("model %s (%s): %.3fM parameters, %.3g FLOPs/token; mesh %s; precision %s", cfg.model, impl.name,
             size.num_params / 1e6, size.flops_per_token, dict(zip(mesh.mesh_dim_names, mesh.shape)),
             plan.precision.name)
    return model, size, context


def materialize(model: nn.Module, cfg: TrainConfig, env: parallel.DistEnv, impl, resuming: bool = False) -> None:
    """Allocate this rank's shards of the sharded meta model and initialize them (or load them from
    --init_from_hf), then check the values. ``resuming``: a checkpoint load overwrites every parameter next (its
    RNG states too): the weights are not drawn first, only the non-persistent buffers are computed."""
    impl.materialize(model, env.device, cfg)
    if resuming:
        impl.reset_buffers(model, env.device)
    elif cfg.init_from_hf:
        try:
            impl.load_hf(model, cfg.init_from_hf)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"--init_from_hf {cfg.init_from_hf}: {e}") from None
        impl.reset_buffers(model, env.device)
        log.info("initialized from Hugging Face checkpoint %s", cfg.init_from_hf)
    else:
        impl.init_weights(model, cfg, env.device)
        impl.check_weights(model, cfg)


def build_sharded(cfg: TrainConfig, env: parallel.DistEnv, plan, impl, prec):
    """The model on the meta device, FP8-converted and sharded over the mesh, nothing allocated yet: (model,
    size, step context, mesh). ``build_model`` goes on to materialize it; ``llama_fp8 estimate`` materializes
    it under fake tensors. ``plan`` is read for ``dims`` and ``precision`` only."""
    from llama_fp8 import precision
    with torch.device("meta"), prec.model_init_context():
        model = impl.build(cfg)
    size = model_size(model, cfg)
    model = prec.convert(model)
    mesh = parallel.build_mesh(plan.dims, env)
    context = parallel.parallelize(model, impl, mesh, cfg, plan.dims, precision.fp8_collectives(plan.precision))
    return model, size, context, mesh


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based): linear warmup, then cosine/linear/constant decay to
    --min_lr over --lr_decay_iters steps, then --min_lr (constant style: --lr throughout)."""
    warmup = int(cfg.warmup * cfg.lr_decay_iters)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    progress = min(max((step - warmup) / max(cfg.lr_decay_iters - warmup, 1), 0.0), 1.0)
    if cfg.lr_decay_style == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device, prec=None) -> torch.optim.Optimizer:
    """AdamW without weight decay on norms, biases and embeddings: the one the precision runtime ``prec`` needs
    (e.g. FP32 masters for FP8 weights), else torch's (fused on CUDA), or torchao.optim's with 8-bit / FP8
    states (--optimizer)."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.dim() < 2 or "embed_tokens" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": 1e-8}
    own = prec.optimizer(groups, **kwargs) if prec is not None else None
    if own is not None:
        log.info("optimizer %s (the precision's own)", type(own).__name__)
        return own
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, fused=device.type == "cuda", **kwargs)
    from torchao.optim import AdamW8bit, AdamWFp8

    opt = (AdamW8bit if cfg.optimizer == "adamw8bit" else AdamWFp8)(groups, **kwargs)
    numel = local_numel(model)
    # AdamW keeps 2 FP32 moments (8 bytes/param); torchao's keep 2 one-byte moments plus one FP32 scale
    # per block of 256 values (8-bit) or one byte each (FP8, block scales likewise).
    low = numel * (2 + 2 * 4 / 256)
    log.info("optimizer %s: states ~%.1f MiB on this rank vs %.1f MiB for FP32 AdamW (saves %.0f %%)",
             cfg.optimizer, low / 2**20, 8 * numel / 2**20, 100 * (1 - low / (8 * numel)))
    return opt


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / cfg.lr if cfg.lr else 0.0)


def build_loaders(cfg: TrainConfig, env: parallel.DistEnv, dims: parallel.ParallelDims | None = None):
    """This rank's endless training batches and, with --validation_freq, its validation batches: one stream per
    data-parallel rank; the ranks of one tensor/context-parallel group read the same batches."""
    from llama_fp8 import data

    dp_rank, dp_world = (env.rank, env.world_size) if dims is None else (dims.dp_rank(env.rank), dims.dp_size)
    try:
        train_loader = data.build_train_loader(cfg, dp_rank, dp_world)
        val_loader = data.build_val_loader(cfg, dp_rank, dp_world) if cfg.validation_freq else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.validation_freq and val_loader is None:
        raise ConfigError(f"--validation_freq {cfg.validation_freq} but --dataset {cfg.dataset} has no validation "
                          f"data: pass --val_data_files or --val_fraction")
    return train_loader, val_loader


def local_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds (its FSDP shards)."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
