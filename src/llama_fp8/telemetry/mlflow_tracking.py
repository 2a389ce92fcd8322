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

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llama_fp8.telemetry.sinks import Sink, scalars

RUN_FILE = "mlflow_run.json"
DEFAULT_EXPERIMENT = "llama-fp8"
STATUS = {"finished": "FINISHED", "signal": "KILLED", "failed": "FAILED"}
MAX_RUN_FILE_BYTES = 64 << 10
# MLflow's own HTTP defaults retry 7 times with a doubling backoff and wait 120 s per request: minutes for a server that
# is gone, at every record and again at exit. A run's MLflow records are a mirror of metrics.jsonl (`publish` fills in
# what a server missed), so a few seconds are enough; a user's own settings of these variables win.
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
PROBE_TIMEOUT_S = 5  # the one check at start: a request without retries
FILE_STORE_ADVICE = ("MLflow 3 keeps file stores in maintenance mode: use sqlite:///<folder>/mlflow.db on the shared "
                     "file system, or a tracking server, or set MLFLOW_ALLOW_FILE_STORE=true to keep the file store")


class _NoRetryLines(logging.Filter):
    """urllib3's "Retrying (Retry(total=...))" warnings, one per retry of a request to the server: the one warning the
    run prints names the server and the cause instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Retrying")


def bound_requests() -> None:
    """MLflow's HTTP retries and timeout bounded (HTTP_SETTINGS, unless set), urllib3's retry lines kept out."""
    for key, value in HTTP_SETTINGS.items():
        os.environ.setdefault(key, value)
    pool = logging.getLogger("urllib3.connectionpool")
    if not any(isinstance(f, _NoRetryLines) for f in pool.filters):
        pool.addFilter(_NoRetryLines())


def client(uri: str):
    try:
        from mlflow import MlflowClient
    except ImportError as e:
        raise ImportError("--mlflow_tracking_uri needs mlflow: pip install 'llama-fp8[mlflow]'") from e
    bound_requests()
    return MlflowClient(tracking_uri=uri)


def cause(error: BaseException) -> str:
    """One line for why a request to MLflow failed: the innermost error of the chain (``Connection refused``, a read
    timeout), or the first sentence of MLflow's own message."""
    inner = error
    while inner.__cause__ is not None or (inner.__context__ is not None and not inner.__suppress_context__):
        inner = inner.__cause__ or inner.__context__
    if inner is not error and isinstance(inner, OSError):
        return f"{type(inner).__name__}: {inner}"
    text = str(error).split(". ")[0].strip()
    return f"{type(error).__name__}: {text[:300]}"


@contextlib.contextmanager
def _one_try() -> Iterator[None]:
    """MLflow's requests without retries and with PROBE_TIMEOUT_S (or the user's own MLFLOW_HTTP_REQUEST_TIMEOUT), while
    the context is open (single-threaded use)."""
    keys = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(dict(zip(keys, ("0", saved[keys[1]] or str(PROBE_TIMEOUT_S)))))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def unreachable(uri: str) -> str | None:
    """Why the tracking store at ``uri`` cannot be used (None: it answered one request). A server gets one request
    without retries, bounded by PROBE_TIMEOUT_S; a database or file store is opened (a file store of MLflow 3 without
    MLFLOW_ALLOW_FILE_STORE is refused here, with what to use instead)."""
    try:
        with _one_try():
            client(uri).search_experiments(max_results=1)
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the store is the answer
        text = cause(e)
        return f"{text} ({FILE_STORE_ADVICE})" if "maintenance mode" in str(e) else text
    return None


def tracking_folder(uri: str) -> Path | None:
    """The folder of a ``sqlite:///`` tracking database (new experiments keep their artifacts beside it, not in the
    working directory's ./mlruns, MLflow's default for a database store), else None."""
    if uri.startswith("sqlite:///") and len(uri) > len("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).resolve().parent
    return None


def experiment_id(mlflow_client, name: str) -> str:
    """The id of experiment ``name``, created when missing (by this process or, at the same moment, another)."""
    from mlflow.exceptions import MlflowException

    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    folder = tracking_folder(mlflow_client.tracking_uri)
    try:
        return mlflow_client.create_experiment(name, artifact_location=(folder / "mlartifacts").as_uri()
                                               if folder else None)
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


def standard_tags() -> dict[str, str]:
    """MLflow's own tags of a run that a team filters by: who ran it (``mlflow.user``) and the code's git commit
    (``mlflow.source.git.commit``, what the UI shows as the run's source version), where known."""
    import getpass

    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_USER

    from llama_fp8.telemetry import repro

    tags = {}
    with contextlib.suppress(Exception):  # no user name in the password database (a container's uid)
        tags[MLFLOW_USER] = getpass.getuser()
    commit = repro.git_state().get("git_commit")
    if commit:
        tags[MLFLOW_GIT_COMMIT] = commit
    return tags


class MlflowSink(Sink):
    """Opens (or, for a resumed run, reopens) the MLflow run; ``params``: config.yaml's content, logged once. Every
    failure is raised as one line naming the tracking URI and the cause (MetricsWriter reports it once)."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, run_dir: Path, params: dict[str, Any],
                 tags: dict[str, str]):
        self.uri = uri
        try:
            self.client = client(uri)
            recorded = read_run_file(run_dir)
            if recorded is not None and recorded["tracking_uri"] == uri:
                self.run_id = recorded["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")
                return
            exp = experiment_id(self.client, experiment)
            self.run_id = self.client.create_run(exp, run_name=run_name,
                                                 tags={**standard_tags(), **tags}).info.run_id
            log_params(self.client, self.run_id, flat_params(params))
        except ImportError:
            raise
        except Exception as e:
            raise RuntimeError(f"MLflow at {uri}: {cause(e)}") from None
        write_run_file(run_dir, uri, exp, self.run_id)

    def write(self, rec: dict, line: str | None = None) -> None:
        try:
            log_records(self.client, self.run_id, [rec])
        except Exception as e:
            raise RuntimeError(f"MLflow at {self.uri}: {cause(e)} (`llama-fp8 publish` fills in the run from "
                               f"metrics.jsonl later)") from None

    def close(self, ended: str) -> None:
        try:
            self.client.set_terminated(self.run_id, status=STATUS.get(ended, "FAILED"))
        except Exception as e:
            raise RuntimeError(f"MLflow at {self.uri}: {cause(e)} (the run stays RUNNING there until `llama-fp8 "
                               f"publish` closes it)") from None
