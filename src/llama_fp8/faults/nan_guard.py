"""Non-finite losses and gradient norms, tracked on the device and read only on logging and checkpoint steps
(``--nan_policy``); the NaN-loss fault injection of tests and drills."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from llama_fp8.faults.inject import FAULT_NAN_ENV, at


class NonFinite(Exception):
    """A non-finite loss or gradient norm (the message names the first such step)."""


class NanGuard:
    """Tracks the first step with a non-finite loss/grad norm on the device; read only when asked."""

    def __init__(self, device: torch.device, policy: str, max_skips: int):
        self.policy, self.max_skips, self.skipped = policy, max_skips, 0
        self._first_bad = torch.full((), -1, dtype=torch.int64, device=device)
        inject = os.environ.get(FAULT_NAN_ENV)
        self.inject_step = int(inject) if inject else None

    def maybe_inject(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Fault injection in the middle of a step (after the forward pass): a NaN loss
        (``LLAMA_FP8_FAULT_NAN_AT_STEP``) or a process fault at point ``step`` (``LLAMA_FP8_FAULT``)."""
        at("step", step)
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
