"""The time limit's lead: is the warning Slurm sends before the end (``#SBATCH --signal=USR1@LEAD``) long enough for
the checkpoint that the warning asks for?

At the warning the ranks finish the step in progress, save, and exit 85; the batch script requeues the job. A save
that is still running at the time limit is killed: the job ends TIMEOUT, which Slurm does not requeue, and the
steps since the previous checkpoint are lost. The rule (``lead_needed``): the lead must cover one step, the save
with half of it again as a margin (a file system is slower some days than others), and ``EXIT_S`` for the exit
and the requeue:

    lead >= step + 1.5 x save + 30 s

The save time is the one measured (this attempt's saves, the save time a checkpoint's manifest recorded) or
predicted (``predicted_save_s``: the state's bytes per node over a stated write bandwidth, the estimate's). A
checkpoint interval that keeps what a TIMEOUT loses small is Daly's for a failure once per time limit
(``suggested_interval_s``).

The batch scripts tell the job its lead (``LEAD_ENV``, from ``SIGNAL_LEAD_S``, ``SBATCH_SIGNAL`` or the script's
``#SBATCH --signal`` line: a ``--signal`` given on sbatch's command line does not reach the job).
"""

from __future__ import annotations

import os
import re

from llama_fp8.telemetry.goodput import checkpoint_interval

LEAD_ENV = "LLAMA_FP8_SIGNAL_LEAD_S"
LIMIT_ENV = "LLAMA_FP8_TIME_LIMIT_S"
SAVE_MARGIN, EXIT_S = 1.5, 30.0
NODE_WRITE_GBPS = 1.0
"""The write bandwidth per node a prediction assumes (GB/s): a shared file system's share per node is often 0.5-2
GB/s; FSx for Lustre and GPFS give more per node, NFS less. A measured save replaces it."""


def lead_from_env(env=None) -> float | None:
    """The lead in seconds (``LEAD_ENV``), or None when the job does not know it."""
    text = (os.environ if env is None else env).get(LEAD_ENV, "")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value > 0 else None


def limit_from_env(env=None) -> float | None:
    """The job's time limit in seconds: ``LIMIT_ENV``, else Slurm's SLURM_JOB_END_TIME - SLURM_JOB_START_TIME."""
    env = os.environ if env is None else env
    try:
        if env.get(LIMIT_ENV):
            return float(env[LIMIT_ENV]) or None
        return float(env["SLURM_JOB_END_TIME"]) - float(env["SLURM_JOB_START_TIME"]) or None
    except (KeyError, ValueError):
        return None


class LeadCheck:
    """Once per attempt, rank 0: the lead against a save time, at start (the checkpoint it resumed from) and after
    the attempt's first save whose time is known (``saved_s(step)``: its manifest's). Logs the warning line."""

    def __init__(self, lead_s: float | None, limit_s: float | None, saved_s, log):
        self.lead_s, self.limit_s, self.saved_s, self.log, self.done = lead_s, limit_s, saved_s, log, lead_s is None

    def at_start(self, save_s: float | None, source: str) -> None:
        line = check(self.lead_s, save_s, None, source, self.limit_s) if not self.done else None
        if line:
            self.log.warning("%s", line)

    def after_save(self, step: int, step_s: float | None) -> None:
        if self.done:
            return
        save_s = self.saved_s(step)
        if save_s is None:  # an async save not written yet: the next save tells
            return
        self.done = True
        line = check(self.lead_s, save_s, step_s, f"the save of step_{step}", self.limit_s)
        if line:
            self.log.warning("%s", line)


def parse_signal(spec: str) -> float | None:
    """Seconds of lead in an sbatch ``--signal`` value (``[{R|B}:]SIG[@TIME]``; Slurm's default is 60 s)."""
    m = re.fullmatch(r"\s*(?:[RB]+:)?[A-Za-z0-9]+(?:@(\d+))?\s*", spec or "")
    return None if m is None else float(m.group(1) or 60)


def lead_needed(save_s: float, step_s: float | None = None) -> float:
    return (step_s or 0.0) + SAVE_MARGIN * save_s + EXIT_S


def predicted_save_s(bytes_per_node: float, gbps: float = NODE_WRITE_GBPS) -> float:
    return bytes_per_node / (gbps * 1e9)


def suggested_interval_s(save_s: float, limit_s: float) -> float:
    """Seconds of training between checkpoints that maximize goodput when the time limit is the failure that comes
    once per job (Daly's interval with MTBF = the time limit)."""
    return checkpoint_interval(max(save_s, 1e-3), limit_s)


def check(lead_s: float | None, save_s: float | None, step_s: float | None, source: str,
          limit_s: float | None = None) -> str | None:
    """A warning line when the lead is shorter than the rule asks for this save (``source``: where the save time
    comes from), with the lead and the checkpoint interval to use; None when it is long enough or unknown."""
    if lead_s is None or save_s is None:
        return None
    need = lead_needed(save_s, step_s)
    if lead_s >= need:
        return None
    step = f" + a step ({step_s:.1f} s)" if step_s else " + a step"
    line = (f"the time-limit warning comes {lead_s:.0f} s before the end (--signal ...@{lead_s:.0f}) but a save takes "
            f"{save_s:.0f} s ({source}): the save started at the warning may not finish, and Slurm would end the job "
            f"TIMEOUT, which it does not requeue. Submit with --signal=USR1@{need + (0 if step_s else 60):.0f} "
            f"(1.5 x the save + 30 s{step})")
    if limit_s and step_s:
        every = suggested_interval_s(save_s, limit_s)
        line += (f", and keep what a TIMEOUT loses small: --checkpoint_freq {max(1, round(every / step_s))} "
                 f"(a save every {every / 60:.0f} min for a {limit_s / 3600:.1f} h time limit)")
    return line
