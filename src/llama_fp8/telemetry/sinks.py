"""Where a run's records go: one interface (``Sink``: ``write(record, line)``, ``close(ended)``) and the writer that
hands every record to every sink (``MetricsWriter``).

The records are metrics.jsonl's (``meta``, ``train``, ``val``, ``fp8_stats``, ``fp8_check``, ``goodput``, ...); each sink
takes what it shows from them: the log line, metrics.jsonl itself, TensorBoard, Weights & Biases and MLflow (their
scalars named ``<type>/<key>`` by ``scalars``, the same everywhere), a Prometheus textfile and OpenTelemetry (the gauges
of gauges.py). Rank 0 writes the run's records; with a Prometheus textfile or OTLP every rank also exports its own
per-rank gauges.

A sink that fails while the run goes on (a full disk, a server gone) is reported once, in a warning that names it,
and left out for the rest of the run: training and the other sinks go on. Sinks that talk to a server over the
network run on a thread of their own (``Background``), so that a slow or dead server never holds up a step.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("llama_fp8.metrics")
SCALAR_TYPES = ("train", "val", "fp8_stats", "goodput")
NOT_SCALARS = ("step", "time", "data_from_step", "start_step")


def scalars(rec: dict) -> dict[str, float]:
    """``{"train/loss": ..., ...}``: a record's numbers under the names TensorBoard, W&B and MLflow all use; empty for
    records that are not scalars over steps."""
    if rec.get("type") not in SCALAR_TYPES or not isinstance(rec.get("step"), int):
        return {}
    return {f"{rec['type']}/{k}": float(v) for k, v in rec.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in NOT_SCALARS}


class Sink:
    """One place a run's records go. ``write`` gets every record (and its log line, if it has one); ``close`` gets how
    the attempt ended: ``finished``, ``signal`` (stopped by SIGUSR1/SIGTERM, saved) or ``failed``."""

    name = "sink"

    def write(self, rec: dict, line: str | None = None) -> None:
        raise NotImplementedError

    def close(self, ended: str) -> None:
        return None

    def abandon(self) -> None:
        """The sink failed and is left out: undo what would mislead if left behind (best effort)."""
        return None


class LineSink(Sink):
    """The log line on stdout (``Batch N Loss: ...``: the prefix log monitors match)."""

    name = "log line"

    def write(self, rec: dict, line: str | None = None) -> None:
        if line:
            print(line, flush=True)


class JsonlSink(Sink):
    """metrics.jsonl, flushed at each record (the report, goodput's restart accounting and a requeue read it)."""

    name = "metrics.jsonl"

    def __init__(self, path: Path):
        self._fh = open(path, "a")

    def write(self, rec: dict, line: str | None = None) -> None:
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()

    def close(self, ended: str) -> None:
        self._fh.close()


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(self, log_dir: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("--tensorboard_dir needs tensorboard: pip install 'llama-fp8[tensorboard]'") from e
        self._tb = SummaryWriter(log_dir=log_dir)

    def write(self, rec: dict, line: str | None = None) -> None:
        values = scalars(rec)
        for key, value in values.items():
            self._tb.add_scalar(key, value, rec["step"])
        if values:
            self._tb.flush()

    def close(self, ended: str) -> None:
        self._tb.close()


class WandbSink(Sink):
    name = "wandb"

    def __init__(self, cfg, run_dir: Path):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("--wandb_project needs wandb: pip install 'llama-fp8[wandb]'") from e
        self._run = wandb.init(project=cfg.wandb_project, mode=cfg.wandb_mode, dir=str(run_dir), name=run_dir.name,
                               config={k: v for k, v in vars(cfg).items() if not k.startswith("_")})

    def write(self, rec: dict, line: str | None = None) -> None:
        values = scalars(rec)
        if values:
            self._run.log(values, step=rec["step"])

    def close(self, ended: str) -> None:
        import wandb

        self._run.finish()
        # Wait for wandb's service process to write everything (offline: the run file) before the training process
        # goes on to exit; its atexit hook alone is not reliable under launchers.
        wandb.teardown()


class Background(Sink):
    """Runs a sink on a thread of its own: ``write`` queues the record and returns. The sink is made on that thread
    too (``make``: connecting may take as long as a server takes to answer). An error of the sink comes back at the
    next ``write`` or at ``close``, which waits at most ``start_timeout_s`` for a sink still being made (default
    ``close_timeout_s``), then at most ``close_timeout_s`` for the records still queued."""

    def __init__(self, name: str, make: Callable[[], Sink], close_timeout_s: float = 60.0, max_queued: int = 10_000,
                 where: str = "", start_timeout_s: float | None = None):
        self.name, self._timeout, self._where = name, close_timeout_s, where
        self._start_timeout = close_timeout_s if start_timeout_s is None else start_timeout_s
        self._made = threading.Event()  # make() has returned or raised
        self._queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, args=(make,), name=f"llama-fp8 {name}", daemon=True)
        self._thread.start()

    def _work(self, make: Callable[[], Sink]) -> None:
        try:
            try:
                sink = make()
            finally:
                self._made.set()
            while True:
                item = self._queue.get()
                if item[0] == "close":
                    sink.close(item[1])
                    return
                sink.write(*item[1:])
        except Exception as e:  # reported by the training thread, at its next write or at close
            self.error = e

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def write(self, rec: dict, line: str | None = None) -> None:
        self._raise()
        try:
            self._queue.put_nowait(("write", dict(rec), line))
        except queue.Full:
            raise RuntimeError(f"{self._queue.qsize()} records wait to be sent: the server is not keeping up") from None

    def close(self, ended: str) -> None:
        if self._thread.is_alive():
            self._made.wait(self._start_timeout)  # a sink still starting (a new sqlite store creating its tables)
            try:
                self._queue.put(("close", ended), timeout=self._timeout)
            except queue.Full:
                pass
            self._thread.join(self._timeout)
        self._raise()
        if self._thread.is_alive():
            raise TimeoutError(f"{self._where + ': ' if self._where else ''}not done after {self._timeout:.0f} s "
                               f"({self._queue.qsize()} records not sent)")


class MetricsWriter:
    """Hands each record to every sink. ``enabled``: this rank writes the run's records (rank 0; others only export
    their per-rank gauges). ``path``: metrics.jsonl (the FP8 statistics go beside it). Without ``sinks``: the log line
    and metrics.jsonl when enabled (what a benchmark or a test needs)."""

    def __init__(self, run_dir: Path, enabled: bool, sinks: list[Sink] | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._sinks = list(sinks) if sinks is not None else ([LineSink(), JsonlSink(self.path)] if enabled else [])

    @property
    def sinks(self) -> list[Sink]:
        return list(self._sinks)

    def write(self, rec: dict, line: str | None = None) -> None:
        for sink in list(self._sinks):
            try:
                sink.write(rec, line)
            except Exception as e:
                self._drop(sink, e, f"at a {rec.get('type')} record of step {rec.get('step')}")

    def _drop(self, sink: Sink, error: BaseException, when: str) -> None:
        """Report a failed sink once, then leave it out: a metrics sink never stops training."""
        self._sinks.remove(sink)
        try:
            sink.abandon()
        except Exception:  # noqa: S110 - the failure itself is what gets reported
            pass
        log.warning("metrics sink %s failed %s (%s: %s); it is off for the rest of this run, training and the other "
                    "sinks go on", sink.name, when, type(error).__name__, error)

    def close(self, ended: str = "finished") -> None:
        for sink in list(self._sinks):
            try:
                sink.close(ended)
            except Exception as e:
                self._drop(sink, e, "while closing")
        self._sinks = []
