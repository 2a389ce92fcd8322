"""Each node's final decision, written for the batch script, which requeues or not (``job_lib.sh``
``lf_outcome``)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

OUTCOME_ENV = "LLAMA_FP8_OUTCOME_DIR"
"""Folder where each node's launcher writes its final decision (``node<N>``: code, action, checkpoint, line).
Actions: ``done``, ``fail`` (not requeued), ``requeue`` (a checkpoint was saved: always requeued), ``retry``
(requeue without a new checkpoint: a signal during a restart, the rendezvous host lost, a machine that fails at
start-up; requeued at most MAX_REQUEUES times), ``closed`` (another node ended the job: its own line says why)."""


def say(line: str) -> None:
    print(f"llama-fp8 launch: {line}", file=sys.stderr, flush=True)


def write_outcome(code: int, action: str, checkpoint: int | None, line: str) -> None:
    """This node's final decision for the batch script (``OUTCOME_ENV``): ``CODE ACTION CHECKPOINT LINE``, the
    checkpoint being the step of the latest complete one a local worker reported (``-``: none known)."""
    folder = os.environ.get(OUTCOME_ENV)
    if not folder:
        return
    name = f"node{os.environ.get('SLURM_NODEID', socket.gethostname())}"
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tmp = Path(folder) / f".{name}.tmp"
        tmp.write_text(f"{code} {action} {'-' if checkpoint is None else checkpoint} {line}\n")
        tmp.replace(Path(folder) / name)
    except OSError as e:
        say(f"warning: could not write the outcome to {folder} ({e.strerror or e})")
