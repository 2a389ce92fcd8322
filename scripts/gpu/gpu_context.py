"""What every step runner of verify.py shares: the visit's Context (paths, results store, key, options,
environment, budget) and its time-boxed ``run``, and small helpers for run dirs and failure records."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import gpu_results
import gpu_timebox
import gpu_units


@dataclass
class Context:
    """One verify invocation: where things go, what it runs with, how long it may take."""

    repo: Path
    work: Path
    python: str
    store: gpu_results.Store
    key: str
    opts: gpu_units.Options
    env: dict[str, str]
    budget: gpu_timebox.Budget
    mirror: Path | None = None
    retry: bool = False
    cache: dict = field(default_factory=dict)

    def run(self, name: str, cmd: list[str], deadline: float, extra_env: dict[str, str] | None = None
            ) -> tuple[gpu_timebox.Outcome, str | None]:
        """Run ``cmd`` until ``deadline`` (time.monotonic) or the budget's end. Returns the outcome and, if it
        was killed, the status that says why: timeout (its own limit) or interrupted (the budget)."""
        limit, by_budget = self.budget.limit(max(deadline - time.monotonic(), 0.0))
        env = {**self.env, **(extra_env or {})}
        out = gpu_timebox.run(cmd, limit, self.work / "logs" / f"{name}.log", env, self.repo)
        killed = ("interrupted" if by_budget else "timeout") if out.timed_out else None
        return out, killed

    def train_cmd(self, flags: list[str]) -> list[str]:
        return [self.python, "-m", "llama_fp8", "train", *flags]


def slug(unit_id: str) -> str:
    """A unit id as a file name (letters, digits, '.', '_', '-': safe in the output folder that comes back)."""
    return unit_id.replace("/", "_").replace(":", "_")


def fresh_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def failure(out: gpu_timebox.Outcome, killed: str | None, what: str) -> dict:
    """The record fields of a command that was killed (timeout / interrupted) or exited non-zero (failed)."""
    if killed:
        return {"status": killed, "message": f"{what}: killed after {out.seconds:.0f} s\n{out.tail(1500)}"}
    return {"status": "failed", "returncode": out.returncode, "message": f"{what}: exit {out.returncode}\n"
            f"{out.tail()}"}


