"""Signals (Slurm preemption / time limit) and non-finite values, detected without per-step device syncs."""

from __future__ import annotations

import logging
import os
import signal

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

FAULT_NAN_ENV = "LLAMA_FP8_FAULT_NAN_AT_STEP"
"""Fault injection for tests and drills: make the loss NaN at this step."""


class Preempted(Exception):
    """SIGUSR1/SIGTERM arrived; a checkpoint was saved at ``step``."""

    def __init__(self, step: int):
        super().__init__(f"stopped by signal after step {step}; checkpoint saved, requeue to resume")
        self.step = step


class NonFinite(Exception):
    """A non-finite loss or gradient norm (the message names the first such step)."""


class SignalWatch:
    """Sets a flag on SIGUSR1/SIGTERM; ``requested()`` agrees on it across ranks.

    Slurm may deliver the signal to some ranks before others, so every rank must take the same decision
    at the same step: a MAX all-reduce of the flag on a CPU (gloo) group each step. It synchronizes host
    threads only, never the GPU, and costs microseconds next to a training step."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, world_size: int):
        self._flag = False
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if not self._flag:
            log.warning("received %s: finishing this step, then saving a checkpoint", signal.Signals(signum).name)
        self._flag = True

    def requested(self) -> bool:
        if self._group is None:
            return self._flag
        t = torch.tensor([1 if self._flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item())

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class NanGuard:
    """Tracks the first step with a non-finite loss/grad norm on the device; read only when asked."""

    def __init__(self, device: torch.device, policy: str, max_skips: int):
        self.policy, self.max_skips, self.skipped = policy, max_skips, 0
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        inject = os.environ.get(FAULT_NAN_ENV)
        self.inject_step = int(inject) if inject else None

    def maybe_inject(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        return loss * float("nan") if step == self.inject_step else loss

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Device-side bookkeeping: no sync."""
        bad = ~torch.isfinite(loss.detach())
        if grad_norm is not None:
            bad = bad | ~torch.isfinite(grad_norm.detach())
        self._first_bad = torch.where(bad & (self._first_bad < 0), step, self._first_bad)

    def step_is_bad(self, grad_norm: torch.Tensor) -> bool:
        """--nan_policy skip: decide now (a host sync, paid only under this policy). The gradient norm is
        global (reduced over ranks), and a NaN loss on any rank makes it NaN, so every rank agrees."""
        bad = not torch.isfinite(grad_norm).item()
        if bad:
            self.skipped += 1
            if self.skipped > self.max_skips:
                raise NonFinite(f"{self.skipped} steps had a non-finite loss or gradient norm (limit "
                                f"--max_nan_skips {self.max_skips})")
        return bad

    def check(self) -> None:
        """Raise if any step so far was non-finite (one sync: call on logging and checkpoint steps)."""
        never = 2**62
        first = torch.where(self._first_bad >= 0, self._first_bad, never)
        if dist.is_initialized() and dist.get_world_size() > 1:  # every rank must stop together
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        first = int(first.item())
        if first < never:
            raise NonFinite(f"non-finite loss or gradient norm at step {first}; stopping without saving "
                            f"(the last complete checkpoint is intact). Lower --lr, check the data, or use "
                            f"--nan_policy skip")
