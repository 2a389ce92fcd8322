"""A node's health, checked by its launcher before it restarts its workers in place: a node that fails the check is
not restarted on but left behind (the job is requeued without it: job_requeue.sh).

The check is ``$LLAMA_FP8_NODE_CHECK`` when set (a site's own script, e.g. NVIDIA's or the cluster's node health
check: exit 0 means healthy), else the GPUs ``nvidia-smi -L`` lists on this node compared with those it listed
when the job started here: a GPU fallen off the bus (Xid 79) disappears from the list. On a node without
``nvidia-smi`` (CPU runs) the built-in check has nothing to look at and passes.
"""

from __future__ import annotations

import os
import shutil
import subprocess

CHECK_ENV = "LLAMA_FP8_NODE_CHECK"
TIMEOUT_S = 60.0
"""A check that has not answered after this long fails (a hung driver, a file system that stopped answering)."""


def gpu_count() -> int | None:
    """GPUs ``nvidia-smi -L`` lists (None: no nvidia-smi on this node)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def problem(gpus_at_start: int | None) -> str | None:
    """What is wrong with this node (one line), or None when it passes."""
    cmd = os.environ.get(CHECK_ENV)
    if cmd:
        try:
            out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return f"the node check ({CHECK_ENV}) did not answer within {TIMEOUT_S:.0f} s"
        if out.returncode != 0:
            said = (out.stderr.strip() or out.stdout.strip()).splitlines()
            return f"the node check ({CHECK_ENV}) failed with exit {out.returncode}" + (f": {said[-1][:200]}"
                                                                                       if said else "")
        return None
    now = gpu_count()
    if gpus_at_start and (now or 0) < gpus_at_start:
        return f"nvidia-smi lists {now or 0} GPU(s), {gpus_at_start} when the job started here (a GPU lost)"
    return None
