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

from llama_fp8 import checkpoint, faults, metrics, parallel
from llama_fp8 import config as config_mod
from llama_fp8 import model as model_mod
from llama_fp8 import precision as precision_mod
from llama_fp8.config import EXIT_BAD_CONFIG, EXIT_NONFINITE, EXIT_REQUEUE, ConfigError, TrainConfig

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
    except parallel.AgreedError as e:  # every rank has it: reported once
        if env.is_main:
            print(f"llama-fp8 train: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except ConfigError as e:
        print(f"llama-fp8 train: error (rank {env.rank}): {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except faults.Preempted as e:
        if env.is_main:
            print(f"llama-fp8 train: {e} (exit code {EXIT_REQUEUE})", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    except faults.NonFinite as e:
        print(f"llama-fp8 train: error (rank {env.rank}): {e}", file=sys.stderr)
        return EXIT_NONFINITE
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
    """AdamW without weight decay on norms, biases and embeddings: torch's (fused on CUDA), or
    torchao.optim's with 8-bit / FP8 states (--optimizer)."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.dim() < 2 or "embed_tokens" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": 1e-8}
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


def prepare_run_dir(cfg: TrainConfig, env: parallel.DistEnv) -> tuple[Path, Path, Path | None]:
    """Rank 0 picks the run dir, the checkpoint dir and the checkpoint to resume from (if any), refuses to
    write over another run's metrics, writes config.yaml; every rank learns the same answer or error."""
    out: list = [None]
    if env.is_main:
        try:
            out[0] = _decide_run_dir(cfg)
        except (ConfigError, ValueError) as e:
            out[0] = str(e)
    if env.world_size > 1:
        dist.broadcast_object_list(out, src=0)
    if isinstance(out[0], str):
        raise parallel.AgreedError(out[0])  # every rank has the same answer: reported once
    run_dir, ckpt_dir, resume = out[0]
    cfg.run_dir, cfg.checkpoint_dir = str(run_dir), str(ckpt_dir)
    return run_dir, ckpt_dir, resume


def _decide_run_dir(cfg: TrainConfig) -> tuple[Path, Path, Path | None]:
    run_dir = Path(cfg.run_dir or config_mod.default_run_dir())
    ckpt_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else run_dir / "checkpoints"
    resume = checkpoint.find_resume(cfg.resume_from_checkpoint, ckpt_dir)
    if (run_dir / "metrics.jsonl").exists() and resume is None:
        raise ConfigError(f"--run_dir {run_dir} already holds metrics.jsonl and there is no checkpoint to resume "
                          f"from in {ckpt_dir}; choose a new --run_dir (nothing was overwritten)")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_dir, cfg.checkpoint_dir = str(run_dir), str(ckpt_dir)
    name = "config.yaml" if resume is None else f"config.resume_{resume.name}.yaml"
    config_mod.dump(cfg, run_dir / name)
    return run_dir, ckpt_dir, resume


def resolve_run(cfg: TrainConfig, env: parallel.DistEnv) -> tuple[str, precision_mod.Precision]:
    """Cheap checks before anything is built or written: data config, model implementation, precision
    and the hardware it needs. Fills the resolved choices into cfg (so config.yaml records them)."""
    from llama_fp8 import data

    try:  # a missing path or a tokenizer without EOS fails here, before any compute (train() agrees)
        data.validate_data_config(cfg, env.world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    import importlib.util

    for flag, module, extra in (("tensorboard_dir", "tensorboard", "tensorboard"), ("wandb_project", "wandb", "wandb")):
        if getattr(cfg, flag) and importlib.util.find_spec(module) is None:
            raise ConfigError(f"--{flag} needs {module}: pip install 'llama-fp8[{extra}]'")
    impl = model_mod.resolve_model_impl(cfg)
    prec = precision_mod.resolve(cfg, impl, env.device, env.world_size)
    cfg.model_impl = impl
    check_device_options(cfg, env)
    if cfg.fp8:
        cfg.fp8_backend, cfg.fp8_recipe = prec.backend, prec.recipe
    return impl, prec


def check_device_options(cfg: TrainConfig, env: parallel.DistEnv) -> None:
    """Options that need CUDA say so on CPU instead of failing deep inside a library."""
    if env.device.type == "cuda":
        return
    if cfg.cpu_offload:
        raise ConfigError("--cpu_offload 1 moves parameters between GPU and host memory and needs CUDA; on CPU "
                          "they are in host memory already: drop it")
    if cfg.optimizer == "adamw_fp8":
        raise ConfigError("--optimizer adamw_fp8 needs CUDA (torchao's FP8 optimizer states have no CPU kernels); "
                          "on CPU use --optimizer adamw8bit")
    if cfg.optimizer != "adamw":
        precision_mod.torchao_import()


def build(cfg: TrainConfig, env: parallel.DistEnv, impl: str, prec: precision_mod.Precision):
    """Model in the fixed order (meta -> FP8 convert -> fully_shard -> to_empty -> init): each rank only
    materializes its own shard."""
    model = model_mod.build_model(cfg, impl, prec.model_init_context())
    size = model_mod.model_size(model, cfg)
    model = prec.convert(model)
    dims = parallel.ParallelDims.from_config(cfg, env)
    mesh = parallel.build_mesh(dims, env)
    parallel.parallelize(model, model_mod.decoder_layers(model), mesh, cfg, impl)
    model.to_empty(device=env.device)
    if cfg.init_from_hf:
        from llama_fp8.convert import load_hf_into_model

        load_hf_into_model(model, cfg.init_from_hf, impl)
        model_mod.reset_rope_buffers(model, env.device)
    else:
        model_mod.init_weights(model, cfg, env.device)
        model_mod.check_weights(model, cfg)
    log.info("model %s (%s): %.3fM parameters, %.3g FLOPs/token; mesh %s; precision %s", cfg.model, impl,
             size.num_params / 1e6, size.flops_per_token, dict(zip(mesh.mesh_dim_names, mesh.shape)), prec.name)
    return model, size


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
    impl, prec = parallel.on_every_rank(env, lambda: resolve_run(cfg, env))
    run_dir, ckpt_dir, resume = prepare_run_dir(cfg, env)
    model, size = build(cfg, env, impl, prec)
    optimizer = build_optimizer(model, cfg, env.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(s, cfg) / cfg.lr if cfg.lr else 0.0)
    train_loader, val_loader = parallel.on_every_rank(env, lambda: build_loaders(cfg, env))
    ckpt = checkpoint.Checkpointer(ckpt_dir, cfg.keep_last_k, cfg.async_checkpoint, env.rank, env.world_size)
    from llama_fp8 import data

    try:
        start = ckpt.load(resume, model, optimizer, scheduler, train_loader, cfg.train_batch_size) if resume else 0
    except data.DataStateError as e:
        raise ConfigError(f"cannot resume from {resume}: {e}") from None
    meter, writer = start_metrics(cfg, env, run_dir, prec, size, start)
    watch = faults.SignalWatch(env.world_size)
    guard = faults.NanGuard(env.device, cfg.nan_policy, cfg.max_nan_skips)
    losses: list[float] = []
    try:
        losses = loop(cfg, env, model, prec, optimizer, scheduler, train_loader, val_loader, ckpt, meter, writer,
                      watch, guard, start)
    finally:
        ckpt.wait()
        watch.close()
        writer.close()
    if env.is_main:
        print(f"Training finished: {cfg.max_steps} steps, run dir {run_dir}", flush=True)
    return {"losses": losses, "local_numel": local_numel(model), "num_params": size.num_params,
            "start_step": start}


def start_metrics(cfg, env, run_dir: Path, prec, size, start: int):
    device_name, peak_bf16, peak_fp8 = metrics.peak_tflops(env.device, cfg.peak_tflops)
    global_batch = cfg.train_batch_size * env.world_size * cfg.grad_accum_steps  # sequences per optimizer step
    meter = metrics.StepMeter(env.device, env.world_size, global_batch, cfg.max_context_width, size.flops_per_token,
                              peak_bf16, peak_fp8, cfg.fp8)
    writer = metrics.MetricsWriter(run_dir, enabled=env.is_main, cfg=cfg)
    writer.write({"type": "meta", "precision": prec.name, "model": cfg.model, "model_impl": cfg.model_impl,
                  "world_size": env.world_size, "device": env.device.type, "device_name": device_name,
                  "peak_tflops_bf16": peak_bf16, "peak_tflops_fp8": peak_fp8, "seq_len": cfg.max_context_width,
                  "global_batch_size": global_batch,
                  "flops_per_token": size.flops_per_token, "num_params": size.num_params,
                  "fp8_emulated": prec.emulated, "start_step": start})
    return meter, writer


def loop(cfg, env, model, prec, optimizer, scheduler, train_loader, val_loader, ckpt, meter, writer, watch, guard,
         start: int) -> list[float]:
    """Steps start+1 .. max_steps. Host syncs happen on logging, validation and checkpoint steps only."""
    from llama_fp8 import data

    batches, losses, window_start = data.Fingerprinted(train_loader), [], start + 1
    model.train()
    for step in range(start + 1, cfg.max_steps + 1):
        log_now = step % cfg.logging_freq == 0 or step == cfg.max_steps
        lr = optimizer.param_groups[0]["lr"]
        loss, grad_norm, data_wait = train_step(model, prec, optimizer, batches, cfg, env.device, step, guard)
        scheduler.step()
        meter.add_step(loss, data_wait)
        if log_now:
            guard.check()
            rec = meter.window(step, lr, grad_norm)
            # rank 0's tokens over steps window_start..step: equal in two runs iff they read the same data
            rec.update(precision=prec.name, world_size=env.world_size, data_crc32=batches.take(),
                       data_from_step=window_start)
            window_start = step + 1
            losses.append(rec["loss"])
            writer.write(rec, metrics.format_line(rec))
        if val_loader is not None and step % cfg.validation_freq == 0:
            writer.write(*validate(model, prec, val_loader, cfg, env, step))
        stop = watch.requested()
        periodic = cfg.checkpoint_freq and (step % cfg.checkpoint_freq == 0 or step == cfg.max_steps)
        if periodic or stop:
            guard.check()  # never write a non-finite model over the last good checkpoint
            ckpt.save(step, model, optimizer, scheduler, train_loader, cfg)
        if stop:
            ckpt.wait()
            raise faults.Preempted(step)
    return losses


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The total gradient norm over all ranks (on device: the NaN guard and the log read it every step),
    and the gradients scaled down to ``max_norm`` if it is > 0; with clipping off they are not touched."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):  # FSDP: the norm of this rank's shards, made global
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def train_step(model, prec, optimizer, batches, cfg: TrainConfig, device: torch.device, step: int, guard):
    """One optimizer step over --grad_accum_steps micro-batches. Returns (mean loss tensor, grad norm
    tensor, seconds blocked on the loader). No host sync (except under --nan_policy skip)."""
    loss_sum, data_wait, accum = None, 0.0, cfg.grad_accum_steps
    for micro in range(accum):
        t0 = time.perf_counter()
        batch = next(batches)
        data_wait += time.perf_counter() - t0
        if accum > 1:  # reduce-scatter gradients on the last micro-batch only
            model.set_requires_gradient_sync(micro == accum - 1)
        input_ids = batch["input_ids"].to(device, non_blocking=True)
        labels = batch["labels"].to(device, non_blocking=True)
        with prec.autocast():  # forward only: TE wants backward outside its FP8 autocast
            logits = model(input_ids=input_ids).logits  # (B, T, V)
        loss = guard.maybe_inject(loss_fn(logits, labels), step)
        (loss / accum).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    loss = loss_sum / accum
    grad_norm = clip_gradients(model, cfg.grad_clip)
    if guard.policy == "skip" and guard.step_is_bad(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, data_wait
    guard.record(step, loss, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    prec.post_step(model)
    return loss, grad_norm, data_wait


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
