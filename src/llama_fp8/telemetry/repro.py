"""What a run needs to be re-run: the code's git commit and whether the checkout had local changes, the
Slurm job, and the exact command. Rank 0 puts it in the meta record (``repro``); the A/B report's
"Reproduce" block and ``compare --repro`` read it back (report/repro.py).

The launch scripts export ``LLAMA_FP8_GIT_COMMIT`` and ``LLAMA_FP8_GIT_DIRTY`` from the host's checkout
(inside a container there may be no git, or no checkout); without them git is asked about the folder this
package was imported from.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

GIT_COMMIT_ENV, GIT_DIRTY_ENV = "LLAMA_FP8_GIT_COMMIT", "LLAMA_FP8_GIT_DIRTY"


def _git(*args: str) -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state(env: dict[str, str] | None = None) -> dict[str, Any]:
    """``{"git_commit": sha or None, "git_dirty": True/False/None}`` (None: not known)."""
    env = dict(os.environ if env is None else env)
    if env.get(GIT_COMMIT_ENV):
        dirty = env.get(GIT_DIRTY_ENV)
        return {"git_commit": env[GIT_COMMIT_ENV], "git_dirty": None if dirty is None else dirty == "1"}
    sha = _git("rev-parse", "HEAD")
    if not sha:
        return {"git_commit": None, "git_dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": sha.strip(), "git_dirty": None if status is None else bool(status.strip())}


def describe(argv: list[str] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The meta record's ``repro``: git state, Slurm job id and node list, torchrun's run id (the same for every
    restart inside the job), and the training flags."""
    env = dict(os.environ if env is None else env)
    return {**git_state(env), "slurm_job_id": env.get("SLURM_JOB_ID"), "elastic_run_id": env.get("TORCHELASTIC_RUN_ID"),
            "slurm_nodelist": env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"),
            "argv": list(sys.argv[1:] if argv is None else argv)}
