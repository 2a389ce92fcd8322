"""Each node's final decision, written for the batch script, which requeues or not (``job_requeue.sh``
``lf_outcome``), and the vocabulary of the launcher's decisions (``JobStop``, ``exit_text``)."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

from llama_fp8.errors import EXIT_BAD_CONFIG, EXIT_NONFINITE, EXIT_REQUEUE, EXIT_TRANSIENT

OUTCOME_ENV = "LLAMA_FP8_OUTCOME_DIR"
"""Folder where each node's launcher writes its final decision (``node<N>``: code, action, checkpoint, failures,
exclusions, line). Actions: ``done``, ``fail`` (not requeued), ``requeue`` (a checkpoint was saved: always
requeued), ``retry`` (requeue without a new checkpoint: a signal during a restart, the rendezvous host lost, a
machine that fails at start-up, a node to leave behind; requeued at most MAX_REQUEUES times), ``closed`` (another
node ended the job: its own line says why), ``left`` (this node was left behind and a spare took its place: the
others went on), ``spare`` (a spare node that was not needed: the step ended while it waited)."""
NOT_RESTARTED = {EXIT_BAD_CONFIG: "a bad flag, config or data file", EXIT_NONFINITE: "a non-finite loss",
                 EXIT_REQUEUE: "a checkpoint saved after SIGUSR1/SIGTERM"}
KINDS = {EXIT_TRANSIENT: "the machine or a service"}


class JobStop(Exception):
    """The job ends here with ``code`` (raised where torch offers no return path: before workers start)."""

    def __init__(self, code: int, action: str, line: str):
        super().__init__(line)
        self.code, self.action, self.line = code, action, line


def exit_text(code: int, kind: str | None = None) -> str:
    """``exit 3 (a non-finite loss)``, ``killed by SIGKILL``, ``exit 75 (an I/O error)``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    why = kind or NOT_RESTARTED.get(code) or KINDS.get(code)
    return f"exit {code}" + (f" ({why})" if why else "")


def say(line: str) -> None:
    print(f"llama-fp8 launch: {line}", file=sys.stderr, flush=True)


def write_outcome(code: int, action: str, checkpoint: int | None, line: str, failed: list[str] | None = None,
                  exclude: list[str] | None = None) -> None:
    """This node's final decision for the batch script (``OUTCOME_ENV``): ``CODE ACTION CHECKPOINT FAILED EXCLUDE
    LINE``, the checkpoint being the step of the latest complete one a local worker reported (``-``: none known),
    FAILED the failures of this training step charged to a node (``node@round:checkpoint``, comma-separated; ``-``:
    none),
    EXCLUDE the nodes to leave behind at once (a failed node check; ``-``: none)."""
    folder = os.environ.get(OUTCOME_ENV)
    if not folder:
        return
    name = f"node{os.environ.get('SLURM_NODEID', socket.gethostname())}"
    fields = [str(code), action, "-" if checkpoint is None else str(checkpoint), ",".join(failed or []) or "-",
              ",".join(exclude or []) or "-", line]
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tmp = Path(folder) / f".{name}.tmp"
        tmp.write_text(" ".join(fields) + "\n")
        tmp.replace(Path(folder) / name)
    except OSError as e:
        say(f"warning: could not write the outcome to {folder} ({e.strerror or e})")
