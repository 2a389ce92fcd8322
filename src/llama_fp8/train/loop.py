"""The training loop: step, log, validate, checkpoint, stop on a signal. Everything it touches is in
the ``TrainState`` (``state.start`` builds it); its bookkeeping is the observer's (``observer.py``)."""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from llama_fp8 import data, faults, parallel
from llama_fp8.telemetry.profiling import phase
from llama_fp8.train.state import TrainState


def local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor for bookkeeping: the (replicated) value of a DTensor loss, else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def loop(s: TrainState) -> list[float]:
    """Steps start+1 .. max_steps. Host syncs happen on logging, validation and checkpoint steps only."""
    cfg, obs, batches = s.cfg, s.observer, data.Fingerprinted(s.train_loader)
    losses = []
    s.model.train()
    obs.begin()
    for step in range(s.start_step + 1, cfg.max_steps + 1):
        lr = s.optimizer.param_groups[0]["lr"]
        obs.step_begins(step)
        loss, grad_norm, data_wait = train_step(s, batches, step)  # forward, backward, optimizer step
        s.scheduler.step()
        obs.step_ends(step, loss, data_wait)
        if step % cfg.logging_freq == 0 or step == cfg.max_steps:
            s.guard.check()
            tokens = s.train_loader.tokens_seen() if hasattr(s.train_loader, "tokens_seen") else None
            losses.append(obs.log(step, lr, grad_norm, batches.take(), tokens))
        if s.val_loader is not None and step % cfg.validation_freq == 0:
            with obs.evaluating(step):
                s.writer.write(*validate(s, step))
        stop = s.watch.requested()
        if stop or (cfg.checkpoint_freq and (step % cfg.checkpoint_freq == 0 or step == cfg.max_steps)):
            s.guard.check()  # never write a non-finite model over the last good checkpoint
            with obs.saving(step):
                s.checkpointer.save(step, s.model, s.optimizer, s.scheduler, s.train_loader, s.cfg, s.plan)
        obs.step_closed(step)
        if stop:
            with obs.waiting_for_save():
                s.checkpointer.wait()
            obs.stopped_by_signal()
            raise faults.Preempted(step)
    with obs.waiting_for_save():  # the final save complete (async: written) before "finished"
        s.checkpointer.wait()
    obs.finished(cfg.max_steps)
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


def on_device(s: TrainState, batch: dict, device: torch.device) -> tuple[dict, torch.Tensor]:
    """The model's inputs (``impl.model_inputs`` of the host batch: with --doc_masking it reads the document
    boundaries there, without a device sync) and the labels, on ``device``."""
    inputs = s.impl.model_inputs(batch["input_ids"], batch.get("position_ids"))
    inputs = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return inputs, batch["labels"].to(device, non_blocking=True)


def train_step(s: TrainState, batches, step: int):
    """One optimizer step over --grad_accum_steps micro-batches. Returns (mean loss tensor, grad norm
    tensor, seconds blocked on the loader). No host sync (except under --nan_policy skip)."""
    model, device, guard = s.model, s.env.device, s.guard
    loss_sum, data_wait, accum = None, 0.0, s.cfg.grad_accum_steps
    for micro in range(accum):
        t0 = time.perf_counter()
        with s.observer.fetching():
            faults.at("data", step)
            batch = next(batches)
        data_wait += time.perf_counter() - t0
        if accum > 1:  # reduce-scatter gradients on the last micro-batch only
            model.set_requires_gradient_sync(micro == accum - 1)
        inputs, labels = on_device(s, batch, device)
        with s.context.step(inputs, labels) as (inputs, labels):
            with phase("forward"):
                with s.precision.autocast():  # forward only: TE wants backward outside its FP8 autocast
                    # The mean cross entropy over this rank's tokens (a share of each sequence under CP), from
                    # logits made a chunk at a time and dropped (parallel/loss.py); the same on a TP group's ranks.
                    loss = s.impl.loss(model, inputs, labels)
                loss = guard.maybe_inject(loss, step)
            with phase("backward"):
                (loss / accum).backward()
        loss = local(loss.detach())
        loss_sum = loss if loss_sum is None else loss_sum + loss
    loss = loss_sum / accum
    grad_norm = clip_gradients(model, s.cfg.grad_clip)
    if guard.policy == "skip" and guard.step_is_bad(grad_norm):
        s.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, data_wait
    guard.record(step, loss, grad_norm)
    with phase("optimizer"):
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        s.precision.post_step(model)
    return loss, grad_norm, data_wait


@torch.no_grad()
def validate(s: TrainState, step: int) -> tuple[dict, str]:
    """Mean loss over --validation_batches per rank, averaged over ranks."""
    s.model.eval()
    total = torch.zeros((), device=s.env.device)
    batches = iter(s.val_loader)
    for _ in range(s.cfg.validation_batches):
        batch = next(batches)
        inputs, labels = on_device(s, batch, s.env.device)
        with s.context.step(inputs, labels) as (inputs, labels):
            with s.precision.autocast():
                total += local(s.impl.loss(s.model, inputs, labels))
    s.model.train()
    val_loss = parallel.all_reduce_mean(total / s.cfg.validation_batches).item()
    ppl = math.exp(min(val_loss, 50.0))
    rec = {"type": "val", "step": step, "val_loss": val_loss, "val_ppl": ppl}
    return rec, f"Validation loss at step {step}: {val_loss:.5f}, perplexity: {ppl:.3f}"
