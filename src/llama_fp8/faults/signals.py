"""Slurm's preemption and time-limit signals (SIGUSR1/SIGTERM): every rank agrees on them at the same step,
without a device sync."""

from __future__ import annotations

import logging
import signal

import torch
import torch.distributed as dist

from llama_fp8.faults.timeouts import collective_timeout

log = logging.getLogger("llama_fp8.faults")


class Preempted(Exception):
    """SIGUSR1/SIGTERM arrived; a checkpoint was saved at ``step``."""

    def __init__(self, step: int):
        super().__init__(f"stopped by signal after step {step}; checkpoint saved, requeue to resume")
        self.step = step


class SignalWatch:
    """Sets a flag on SIGUSR1/SIGTERM; ``requested()`` agrees on it across ranks.

    Slurm may deliver the signal to some ranks before others, so every rank must take the same decision
    at the same step: a MAX all-reduce of the flag on a CPU (gloo) group each step. It synchronizes host
    threads only, never the GPU, and costs microseconds next to a training step."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, world_size: int):
        self._flag = False
        self._group = dist.new_group(backend="gloo", timeout=collective_timeout()) if world_size > 1 else None
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def _handle(self, signum, frame) -> None:
        if not self._flag:
            log.warning("received %s: finishing this step, then saving a checkpoint", signal.Signals(signum).name)
        else:
            log.warning("received %s again: already stopping (the checkpoint is being saved)",
                        signal.Signals(signum).name)
        self._flag = True

    def requested(self) -> bool:
        if self._group is None:
            return self._flag
        t = torch.tensor([1 if self._flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item())

    def close(self) -> None:
        """Give the signals back, unless one arrived: then the process is on its way out with the requeue
        code, and a repeated signal (Slurm sends SIGTERM at the time limit after the USR1 warning; an
        operator may signal twice) must not kill it before it exits - the default action of both signals
        is to terminate, which would turn exit code 85 into a signal death and lose the requeue. SIG_IGN
        (not a Python handler) also holds through interpreter shutdown, which resets Python handlers.

        Without a signal, the previous handlers come back, except a default SIGUSR1: Slurm's time-limit warning
        can land after the last step, while the run tears down; nothing is left to save then, and its default
        action would turn a finished run into a signal death (a FAILED job, srun's "User defined signal 1")."""
        for s, handler in self._previous.items():
            late_warning = s == signal.SIGUSR1 and handler == signal.SIG_DFL
            signal.signal(s, signal.SIG_IGN if self._flag or late_warning else handler)
