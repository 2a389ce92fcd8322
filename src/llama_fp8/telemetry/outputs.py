"""Which sinks (sinks.py) a run writes to, from its flags: ``open_writer``.

Rank 0: the log line and metrics.jsonl always; TensorBoard (``--tensorboard_dir``), Weights & Biases
(``--wandb_project``) and MLflow (``--mlflow_tracking_uri``) when asked. Every rank: the Prometheus textfile
(``--prometheus_textfile_dir``) and OTLP (``--otlp_endpoint``) when asked, rank 0 with the job-wide gauges, each rank
with its per-rank ones. The packages they need were checked before training (plan.decide_setup); a sink that still
cannot start is reported and the run goes on without it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_fp8.telemetry import sinks
from llama_fp8.telemetry.gauges import Board

log = logging.getLogger("llama_fp8.metrics")


@dataclass(frozen=True)
class Origin:
    """Who writes: this rank of this run, and the labels its gauges carry."""

    run_dir: Path
    rank: int
    local_rank: int
    is_main: bool
    precision: str
    slurm_job_id: str = ""
    node: str = ""

    @classmethod
    def here(cls, run_dir: Path, rank: int, local_rank: int, is_main: bool, precision: str,
             env: dict[str, str] | None = None) -> Origin:
        """The Slurm job and the node from the environment (the hostname outside Slurm)."""
        env = os.environ if env is None else env
        return cls(Path(run_dir), rank, local_rank, is_main, precision, env.get("SLURM_JOB_ID") or "",
                   env.get("SLURMD_NODENAME") or socket.gethostname())

    def labels(self) -> dict[str, str]:
        return {"slurm_job_id": self.slurm_job_id, "node": self.node, "run": self.run_name, "run_id": self.run_id,
                "precision": self.precision}

    @property
    def run_name(self) -> str:
        """The run folder's parent and name (``pair2/bf16``: an A/B's pairs in one job tell apart)."""
        return f"{self.run_dir.parent.name}/{self.run_dir.name}" if self.run_dir.parent.name else self.run_dir.name

    @property
    def run_id(self) -> str:
        """8 hex digits of the run folder's full path: unique where folder names repeat (two runs outside Slurm)."""
        return hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:8]

    def board(self) -> Board:
        return Board(self.labels(), self.rank, self.local_rank, self.is_main)


def open_writer(cfg, origin: Origin, params: dict[str, Any]) -> sinks.MetricsWriter:
    """``params``: what config.yaml holds (``{"asked": ..., "resolved": ...}``), for MLflow."""
    out: list[sinks.Sink] = []

    def add(name: str, make: Callable[[], sinks.Sink]) -> None:
        try:
            out.append(make())
        except Exception as e:
            log.warning("metrics sink %s could not start (%s: %s); the run goes on without it", name,
                        type(e).__name__, e)

    if origin.is_main:
        out += [sinks.LineSink(), sinks.JsonlSink(origin.run_dir / "metrics.jsonl")]
        if cfg.tensorboard_dir:
            add("tensorboard", lambda: sinks.TensorBoardSink(cfg.tensorboard_dir))
        if cfg.wandb_project:
            add("wandb", lambda: sinks.WandbSink(cfg, origin.run_dir))
        if cfg.mlflow_tracking_uri and _mlflow_answers(cfg.mlflow_tracking_uri):
            # closing waits a few seconds at most: what a gone server missed, `publish` fills in from metrics.jsonl;
            # a store still starting gets a minute (a new sqlite store creates its tables: seconds, more on a busy
            # node or a shared file system; a short run used to end first, leaving its MLflow run RUNNING)
            out.append(sinks.Background("mlflow", lambda: _mlflow(cfg, origin, params), close_timeout_s=5.0,
                                        start_timeout_s=60.0, where=f"MLflow at {cfg.mlflow_tracking_uri}"))
    if cfg.prometheus_textfile_dir:
        from llama_fp8.telemetry import prometheus

        name = prometheus.file_name(origin.slurm_job_id, f"{origin.run_name}_{origin.run_id}", origin.rank)
        add("prometheus textfile", lambda: prometheus.TextfileSink(cfg.prometheus_textfile_dir, origin.board(),
                                                                   origin.run_dir, name))
    if cfg.otlp_endpoint:
        from llama_fp8.telemetry import otlp

        add("otlp", lambda: otlp.OtlpSink(cfg.otlp_endpoint, origin.board()))
    return sinks.MetricsWriter(origin.run_dir, origin.is_main, out)


DATABASES = ("sqlite:", "postgresql", "mysql", "mssql")


def _mlflow_answers(uri: str) -> bool:
    """One bounded check at start (a server, a file store): when the store does not answer, one warning naming it and
    the cause, and the run goes on without MLflow (nothing waits for it later). A database is opened on the sink's
    own thread instead (its first use creates its tables: seconds), and a failure there is reported the same way."""
    from llama_fp8.telemetry import mlflow_tracking

    if uri.startswith(DATABASES):
        return True
    try:
        why = mlflow_tracking.unreachable(uri)
    except ImportError as e:
        why = str(e)
    if why is not None:
        log.warning("metrics sink mlflow: MLflow at %s cannot be used (%s); the run goes on without MLflow "
                    "(`llama-fp8 publish` can add it later from metrics.jsonl)", uri, why)
    return why is None


def _mlflow(cfg, origin: Origin, params: dict[str, Any]) -> sinks.Sink:
    from llama_fp8.telemetry import mlflow_tracking

    tags = {"precision": origin.precision, "slurm_job_id": origin.slurm_job_id, "node": origin.node,
            "run_dir": str(origin.run_dir.resolve()), "model": str(cfg.model)}
    return mlflow_tracking.MlflowSink(cfg.mlflow_tracking_uri, cfg.mlflow_experiment,
                                      cfg.mlflow_run_name or origin.run_dir.name, origin.run_dir, params, tags)
