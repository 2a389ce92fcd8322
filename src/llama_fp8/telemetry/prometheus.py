"""``--prometheus_textfile_dir``: the run's gauges (gauges.py) as a textfile for node_exporter's textfile collector,
which every node of a SageMaker HyperPod or ParallelCluster observability stack can run beside the DCGM and EFA
exporters (docs/metrics.md).

Each rank writes its own file, ``llama_fp8_job<SLURM_JOB_ID>_<run>_<run_id>_rank<R>.prom`` (the run folder's parent and
name, and a hash of its path: two runs never share a file; rank 0 with the job-wide gauges,
every rank with its per-rank ones), at every record that changes a value, through prometheus_client's
``write_to_textfile``: a temporary file in the same folder (not ``*.prom``, so the collector never reads half a file),
then a rename, as the collector requires. At the end the file leaves the collector's folder, so that a finished run
stops being exported (a dashboard would otherwise draw its last values on as a flat line), and its last state is kept
in ``<run_dir>/prometheus/``. A process killed before its end leaves its file: the epilog line in docs/metrics.md
removes a job's files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from llama_fp8.telemetry.gauges import Board
from llama_fp8.telemetry.sinks import Sink

FINAL_DIR = "prometheus"  # in the run dir: each rank's last textfile


def file_name(slurm_job_id: str, run: str, rank: int) -> str:
    """This rank's textfile: named by job, run and rank (a job's files share the prefix ``llama_fp8_job<ID>_``, which
    an epilog can remove); characters outside ``[A-Za-z0-9_.-]`` become ``_``."""
    def clean(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:100]
    job = f"job{clean(slurm_job_id)}_" if slurm_job_id else ""
    return f"llama_fp8_{job}{clean(run)}_rank{rank}.prom"


def check_dir(path: str) -> str | None:
    """None when ``path`` is a folder this process can write in, else what is wrong with it."""
    folder = Path(path)
    if not folder.is_dir():
        return "is not a folder" if folder.exists() else "does not exist (node_exporter's textfile folder is made " \
                                                         "by its setup; create it first)"
    if not os.access(folder, os.W_OK | os.X_OK):
        return "is not writable by this user"
    return None


class _Collector:
    """prometheus_client's view of a Board: one metric family per gauge with a value."""

    def __init__(self, board: Board):
        self.board = board

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for gauge, samples in self.board.samples():
            names = list(samples[0][0])
            family = (CounterMetricFamily if gauge.counter else GaugeMetricFamily)(gauge.name, gauge.help, labels=names)
            for labels, value in samples:
                family.add_metric([labels[n] for n in names], value)
            yield family


class TextfileSink(Sink):
    name = "prometheus textfile"

    def __init__(self, folder: str, board: Board, run_dir: Path, name: str):
        try:
            from prometheus_client import CollectorRegistry
        except ImportError as e:
            raise ImportError("--prometheus_textfile_dir needs prometheus_client: "
                              "pip install 'llama-fp8[prometheus]'") from e
        self.board, self.path = board, Path(folder) / name
        self.final = Path(run_dir) / FINAL_DIR / name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(board))

    def _write(self, path: Path) -> None:
        from prometheus_client import write_to_textfile

        write_to_textfile(str(path), self.registry)

    def write(self, rec: dict, line: str | None = None) -> None:
        if self.board.update(rec):
            self._write(self.path)

    def abandon(self) -> None:
        """A failed textfile leaves the collector's folder: its last values would be exported on as if current."""
        self.path.unlink(missing_ok=True)

    def close(self, ended: str) -> None:
        """The last state into the run dir, then out of the collector's folder."""
        try:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self._write(self.final)
        finally:
            self.path.unlink(missing_ok=True)
