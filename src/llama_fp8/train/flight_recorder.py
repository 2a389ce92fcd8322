"""NCCL's flight recorder: where each rank dumps its last collectives on a timeout, chosen before the process
group starts."""

from __future__ import annotations

import os

from llama_fp8.config import TrainConfig, default_run_dir

FLIGHT_RECORDER_DIR = "comm_traces"
"""Where NCCL's flight recorder dumps each rank's last collectives on a timeout, inside the run folder."""


def set_dump_path(cfg: TrainConfig) -> str | None:
    """With the flight recorder on (``TORCH_FR_BUFFER_SIZE``: the batch scripts set it on CUDA; gloo records too) and
    no dump path chosen: ``<run_dir>/comm_traces/rank_`` (the folder created; torch appends the rank), set in the
    environment before the process group reads it. Torch dumps there on an NCCL timeout, and every rank when the
    launcher asks before it kills a hung attempt (telemetry/heartbeat.py). None when the recorder is off, or when
    the run folder is not known yet on every rank (no --run_dir outside Slurm: its default name holds the start
    time)."""
    if not int(os.environ.get("TORCH_FR_BUFFER_SIZE") or 0):
        return None
    if os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or not (cfg.run_dir or os.environ.get("SLURM_JOB_ID")):
        return None
    folder = os.path.join(cfg.run_dir or default_run_dir(), FLIGHT_RECORDER_DIR)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None  # the run folder's own checks report an unwritable --run_dir, naming it
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(folder, "rank_")
    return os.environ["TORCH_FR_DUMP_TEMP_FILE"]
