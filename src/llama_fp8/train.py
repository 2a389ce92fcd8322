"""The training loop: build everything in a fixed order, step, log, validate.

meta model -> precision.convert -> parallelize (fully_shard) -> to_empty + init -> optimizer -> loop.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llama_fp8 import config as config_mod
from llama_fp8 import metrics, model as model_mod, parallel, precision as precision_mod
from llama_fp8.config import EXIT_BAD_CONFIG, ConfigError, TrainConfig

log = logging.getLogger("llama_fp8.train")


def main(argv: list[str]) -> int:
    try:
        cfg = config_mod.parse_args(argv)
    except ConfigError as e:
        print(f"llama-fp8 train: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return run(cfg)


def run(cfg: TrainConfig) -> int:
    """Run one training job in this process (one rank); returns the exit code."""
    try:
        env = parallel.init_distributed(cfg)
    except ConfigError as e:
        print(f"llama-fp8 train: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        metrics.setup_logging(env.is_main)
        train(cfg, env)
        return 0
    except ConfigError as e:
        print(f"llama-fp8 train: error (rank {env.rank}): {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    finally:
        parallel.destroy_distributed()


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


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW without weight decay on norms, biases and embeddings; fused on CUDA."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.dim() < 2 or "embed_tokens" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                             fused=device.type == "cuda")


def prepare_run_dir(cfg: TrainConfig, env: parallel.DistEnv) -> Path:
    """Rank 0 picks and creates the run dir and writes config.yaml; every rank learns the path or the error."""
    out: list = [None, None]
    if env.is_main:
        run_dir = Path(cfg.run_dir or config_mod.default_run_dir())
        if (run_dir / "metrics.jsonl").exists():
            out[1] = (f"--run_dir {run_dir} already holds metrics.jsonl from another run; choose a new --run_dir "
                      f"(nothing was overwritten)")
        else:
            run_dir.mkdir(parents=True, exist_ok=True)
            cfg.run_dir = str(run_dir)
            config_mod.dump(cfg, run_dir / "config.yaml")
            out[0] = str(run_dir)
    if env.world_size > 1:
        dist.broadcast_object_list(out, src=0)
    if out[1]:
        raise ConfigError(out[1])
    cfg.run_dir = out[0]
    return Path(out[0])


def build(cfg: TrainConfig, env: parallel.DistEnv):
    """Model, precision and mesh in the fixed order; each rank only materializes its own shard."""
    from llama_fp8 import data

    try:  # a missing path or a tokenizer without EOS fails here, on every rank, before any compute
        data.validate_data_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    impl = model_mod.resolve_model_impl(cfg)
    prec = precision_mod.resolve(cfg, impl, env.device)  # hardware checks before anything is built
    cfg.model_impl = impl
    if cfg.fp8:
        cfg.fp8_backend, cfg.fp8_recipe = prec.backend, prec.recipe
    model = model_mod.build_model(cfg, impl)
    size = model_mod.model_size(model, cfg)
    model = prec.convert(model)
    dims = parallel.ParallelDims.from_config(cfg, env)
    mesh = parallel.build_mesh(dims, env)
    parallel.parallelize(model, model_mod.decoder_layers(model), mesh, cfg)
    model.to_empty(device=env.device)
    model_mod.init_weights(model, cfg, env.device)
    model_mod.check_weights(model, cfg)
    log.info("model %s (%s): %.3fM parameters, %.3g FLOPs/token; mesh %s; precision %s", cfg.model, impl,
             size.num_params / 1e6, size.flops_per_token, dict(zip(mesh.mesh_dim_names, mesh.shape)), prec.name)
    return model, prec, size


def build_loaders(cfg: TrainConfig, env: parallel.DistEnv):
    """This rank's endless training batches and, with --validation_freq, its validation batches."""
    from llama_fp8 import data

    try:
        train_loader = data.build_train_loader(cfg, env.rank, env.world_size)
        val_loader = data.build_val_loader(cfg, env.rank, env.world_size) if cfg.validation_freq else None
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.validation_freq and val_loader is None:
        raise ConfigError(f"--validation_freq {cfg.validation_freq} but --dataset {cfg.dataset} has no validation "
                          f"data: pass --val_data_files or --val_fraction")
    return train_loader, val_loader


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; labels are already aligned with logits (B, T), -100 ignored."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


def local_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds (its FSDP shards)."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)


def train(cfg: TrainConfig, env: parallel.DistEnv) -> dict:
    """Train; returns this rank's summary: logged (rank-averaged) losses and parameter counts."""
    torch.manual_seed(cfg.seed)
    model, prec, size = build(cfg, env)
    run_dir = prepare_run_dir(cfg, env)
    optimizer = build_optimizer(model, cfg, env.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / cfg.lr if cfg.lr else 0.0)
    train_loader, val_loader = build_loaders(cfg, env)
    device_name, peak_bf16, peak_fp8 = metrics.peak_tflops(env.device, cfg.peak_tflops)
    meter = metrics.StepMeter(env.device, env.world_size, cfg.train_batch_size * env.world_size,
                              cfg.max_context_width, size.flops_per_token, peak_bf16, peak_fp8, cfg.fp8)
    writer = metrics.MetricsWriter(run_dir, enabled=env.is_main)
    writer.write({"type": "meta", "precision": prec.name, "model": cfg.model, "model_impl": cfg.model_impl,
                  "world_size": env.world_size, "device": env.device.type, "device_name": device_name,
                  "peak_tflops_bf16": peak_bf16, "peak_tflops_fp8": peak_fp8, "seq_len": cfg.max_context_width,
                  "global_batch_size": cfg.train_batch_size * env.world_size,
                  "flops_per_token": size.flops_per_token, "num_params": size.num_params,
                  "fp8_emulated": prec.emulated})
    batches = iter(train_loader)
    losses: list[float] = []
    model.train()
    for step in range(1, cfg.max_steps + 1):
        log_now = step % cfg.logging_freq == 0 or step == cfg.max_steps
        t0 = time.perf_counter()
        batch = next(batches)
        data_wait = time.perf_counter() - t0
        loss, grad_norm = train_step(model, prec, optimizer, batch, cfg, env.device, log_now)
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()
        meter.add_step(loss, data_wait)
        if log_now:
            rec = meter.window(step, lr, grad_norm)
            rec.update(precision=prec.name, world_size=env.world_size)
            losses.append(rec["loss"])
            writer.write(rec, metrics.format_line(rec))
        if val_loader is not None and step % cfg.validation_freq == 0:
            writer.write(*validate(model, prec, val_loader, cfg, env, step))
    writer.close()
    if env.is_main:
        print(f"Training finished: {cfg.max_steps} steps, run dir {run_dir}", flush=True)
    return {"losses": losses, "local_numel": local_numel(model), "num_params": size.num_params}


def train_step(model, prec, optimizer, batch, cfg: TrainConfig, device: torch.device, log_now: bool):
    """One optimizer step. Returns (loss tensor on device, grad norm or None); no host sync here."""
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    with prec.autocast():  # forward only: TE wants backward outside its FP8 autocast
        logits = model(input_ids=input_ids).logits  # (B, T, V)
    loss = loss_fn(logits, labels)
    loss.backward()
    grad_norm = None
    if cfg.grad_clip > 0 or log_now:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    prec.post_step(model)
    return loss, (grad_norm if log_now else None)


@torch.no_grad()
def validate(model, prec, val_loader, cfg: TrainConfig, env: parallel.DistEnv, step: int) -> tuple[dict, str]:
    """Mean loss over --validation_batches per rank, averaged over ranks."""
    model.eval()
    total = torch.zeros((), device=env.device)
    batches = iter(val_loader)
    for _ in range(cfg.validation_batches):
        batch = next(batches)
        with prec.autocast():
            logits = model(input_ids=batch["input_ids"].to(env.device)).logits
        total += loss_fn(logits, batch["labels"].to(env.device))
    model.train()
    val_loss = parallel.all_reduce_mean(total / cfg.validation_batches).item()
    ppl = math.exp(min(val_loss, 50.0))
    rec = {"type": "val", "step": step, "val_loss": val_loss, "val_ppl": ppl}
    return rec, f"Validation loss at step {step}: {val_loss:.5f}, perplexity: {ppl:.3f}"
