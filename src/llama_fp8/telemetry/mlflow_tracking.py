"""``--mlflow_tracking_uri``: the run as an MLflow run. Its params are config.yaml's (what was asked under the field
names, what was resolved under ``resolved.<key>``), its metrics the scalars of every logged record (``train/loss``,
``val/val_loss``, ``fp8_stats/...``, ``goodput/...``: the names TensorBoard and W&B get), its tags the precision, the
Slurm job, the node and the run folder. The tracking URI is anything MLflow takes: a server (``http://host:5000``), a
database, a file store on a shared file system, or SageMaker's managed MLflow (an ARN, with the ``sagemaker-mlflow``
plugin installed).

The MLflow run's id is kept in ``<run_dir>/mlflow_run.json``: an attempt that resumes the run (a restart, a requeue)
goes on in the same MLflow run, and ``llama-fp8 publish`` finds it to make it a child of an A/B's run. Rank 0 only;
the sink runs on a thread of its own (sinks.Background), so a slow or gone server never holds up training.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from llama_fp8.telemetry.sinks import Sink, scalars

RUN_FILE = "mlflow_run.json"
DEFAULT_EXPERIMENT = "llama-fp8"
STATUS = {"finished": "FINISHED", "signal": "KILLED", "failed": "FAILED"}
MAX_RUN_FILE_BYTES = 64 << 10


def client(uri: str):
    try:
        from mlflow import MlflowClient
    except ImportError as e:
        raise ImportError("--mlflow_tracking_uri needs mlflow: pip install 'llama-fp8[mlflow]'") from e
    return MlflowClient(tracking_uri=uri)


def experiment_id(mlflow_client, name: str) -> str:
    """The id of experiment ``name``, created when missing (by this process or, at the same moment, another)."""
    from mlflow.exceptions import MlflowException

    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return mlflow_client.create_experiment(name)
    except MlflowException:  # the other arm of an A/B created it first
        return mlflow_client.get_experiment_by_name(name).experiment_id


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


def flat_params(config: dict[str, Any]) -> dict[str, str]:
    """config.yaml's ``{"asked": ..., "resolved": ...}`` as MLflow params: asked fields under their names, resolved
    decisions under ``resolved.<key>`` (nested keys joined by dots); values as text, cut to MLflow's length limit."""
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    flat: dict[str, Any] = {}
    _flatten("", config.get("asked") or {}, flat)
    _flatten("resolved", config.get("resolved") or {}, flat)
    return {k: (v if isinstance(v, str) else json.dumps(v))[:MAX_PARAM_VAL_LENGTH] for k, v in flat.items()}


def log_params(mlflow_client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param
    from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH

    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
        mlflow_client.log_batch(run_id, params=items[i:i + MAX_PARAMS_TAGS_PER_BATCH])


def log_records(mlflow_client, run_id: str, records: list[dict]) -> int:
    """Every record's scalars as MLflow metrics at its step and time; returns how many values were logged."""
    from mlflow.entities import Metric
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH

    now = int(time.time() * 1000)
    items = [Metric(key, value, int(rec["time"] * 1000) if isinstance(rec.get("time"), (int, float)) else now,
                    rec["step"]) for rec in records for key, value in scalars(rec).items()]
    for i in range(0, len(items), MAX_METRICS_PER_BATCH):
        mlflow_client.log_batch(run_id, metrics=items[i:i + MAX_METRICS_PER_BATCH])
    return len(items)


def read_run_file(folder: Path) -> dict[str, str] | None:
    """``{"tracking_uri", "experiment_id", "run_id"}`` recorded in ``folder``, or None (absent, too large, not that)."""
    path = Path(folder) / RUN_FILE
    try:
        if path.stat().st_size > MAX_RUN_FILE_BYTES:
            return None
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    keys = ("tracking_uri", "experiment_id", "run_id")
    if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in keys):
        return None
    return {k: rec[k] for k in keys}


def write_run_file(folder: Path, uri: str, experiment: str, run_id: str) -> None:
    path = Path(folder) / RUN_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"tracking_uri": uri, "experiment_id": experiment, "run_id": run_id}) + "\n")
    tmp.replace(path)


class MlflowSink(Sink):
    """Opens (or, for a resumed run, reopens) the MLflow run; ``params``: config.yaml's content, logged once."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, run_dir: Path, params: dict[str, Any],
                 tags: dict[str, str]):
        self.client = client(uri)
        recorded = read_run_file(run_dir)
        if recorded is not None and recorded["tracking_uri"] == uri:
            self.run_id = recorded["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        exp = experiment_id(self.client, experiment)
        self.run_id = self.client.create_run(exp, run_name=run_name, tags=tags).info.run_id
        log_params(self.client, self.run_id, flat_params(params))
        write_run_file(run_dir, uri, exp, self.run_id)

    def write(self, rec: dict, line: str | None = None) -> None:
        log_records(self.client, self.run_id, [rec])

    def close(self, ended: str) -> None:
        self.client.set_terminated(self.run_id, status=STATUS.get(ended, "FAILED"))
