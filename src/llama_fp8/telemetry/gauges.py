"""The gauges a run exports where clusters already look: node_exporter's textfile collector (prometheus.py) and an
OpenTelemetry collector (otlp.py). One table (``GAUGES``) read by both, filled from the same records that
metrics.jsonl holds, so that every exported value is a value of metrics.jsonl (in the unit its name says).

Names follow Prometheus' conventions: the ``llama_fp8_`` prefix, the base unit in the name (``_seconds``, ``_bytes``,
``_ratio`` for shares from 0 to 1), ``_total`` for counters. Every sample carries the labels of ``Board``: the Slurm
job (``slurm_job_id``, as NCCL's inspector labels its textfiles; DCGM's exporter calls it ``hpc_job``), the ``node``,
the ``run`` (the run folder's parent and name: ``pair2/bf16``, ``runs/job_77``), the ``run_id`` (a short hash of the run
folder's full path: two runs whose folders share names never share a series) and the ``precision``; per-rank gauges add ``rank`` and ``local_rank``.
Job-wide gauges come from rank 0 only; each rank exports its own per-rank gauges.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

GIB = 2**30
NO_STRAGGLER = -1


@dataclass(frozen=True)
class Gauge:
    name: str
    help: str
    source: str  # where the value comes from, for docs/metrics.md's table
    counter: bool = False
    per_rank: bool = False  # every rank exports its own sample (labels rank, local_rank); else rank 0 only
    label: str | None = None  # one more label that tells this gauge's samples apart (peak, tensor)
    info: tuple[str, ...] = ()  # an _info gauge: value 1, these labels (from the meta record) beside the job's


INFO_LABELS = ("model", "model_impl", "device_name", "git_commit")


GAUGES = (
    Gauge("llama_fp8_run_info", "1, with the run's model, implementation, device and code commit as labels (the "
          "_info convention: join it on the job labels)", "meta: model, model_impl, device_name, repro.git_commit",
          info=INFO_LABELS),
    Gauge("llama_fp8_step", "last logged optimizer step", "train: step"),
    Gauge("llama_fp8_train_loss", "mean training loss over the logging window, averaged over ranks", "train: loss"),
    Gauge("llama_fp8_validation_loss", "validation loss", "val: val_loss"),
    Gauge("llama_fp8_learning_rate", "learning rate of the logged step", "train: lr"),
    Gauge("llama_fp8_grad_norm", "global gradient norm of the logged step (before clipping)", "train: grad_norm"),
    Gauge("llama_fp8_tokens_per_second", "training tokens per second, all devices", "train: tokens_per_sec"),
    Gauge("llama_fp8_device_tokens_per_second", "training tokens per second per device",
          "train: tokens_per_sec_per_device"),
    Gauge("llama_fp8_device_flops_per_second", "model FLOPs per second per device (6N + attention, counted in full)",
          "train: tflops_per_device x 1e12"),
    Gauge("llama_fp8_mfu_ratio", "model FLOPs utilization against the dense peak named by the peak label",
          "train: mfu_vs_bf16_peak, mfu_vs_fp8_peak", label="peak"),
    Gauge("llama_fp8_data_wait_ratio", "share of the logging window spent waiting for the data loader",
          "train: data_wait_frac"),
    Gauge("llama_fp8_goodput_ratio", "productive training time over wall time of this attempt so far (the final "
          "value at the end)", "train: goodput; goodput: goodput"),
    Gauge("llama_fp8_straggler_rank", f"slowest rank named a straggler in the last logging window ({NO_STRAGGLER}: "
          "none)", "train: stragglers[0].rank"),
    Gauge("llama_fp8_stragglers", "ranks named stragglers in the last logging window", "train: len(stragglers)"),
    Gauge("llama_fp8_fp8_underflow_ratio", "share of nonzero values that underflow to zero in FP8, worst layer, by "
          "tensor role (--fp8_stats)", "fp8_stats: <tensor>_underflow_max", label="tensor"),
    Gauge("llama_fp8_fp8_snr_decibels", "FP8 quantization signal-to-noise ratio, worst layer, by tensor role "
          "(--fp8_stats)", "fp8_stats: <tensor>_snr_db_min", label="tensor"),
    Gauge("llama_fp8_restarts_total", "earlier attempts of this run (restarts inside the allocation and requeues)",
          "meta: restarts", counter=True),
    Gauge("llama_fp8_memory_high_water_bytes", "device memory high-water mark (CUDA max allocated; peak RSS on CPU)",
          "train: ranks[r].mem_peak_gib x 2^30", per_rank=True),
    Gauge("llama_fp8_rank_step_seconds", "this rank's mean step time without data wait over the logging window",
          "train: ranks[r].step_s", per_rank=True),
    Gauge("llama_fp8_rank_data_wait_seconds", "this rank's mean data wait per step over the logging window",
          "train: ranks[r].data_wait_s", per_rank=True),
)
BY_NAME = {g.name: g for g in GAUGES}
JOB_LABELS = ("slurm_job_id", "node", "run", "run_id", "precision")
RANK_LABELS = ("rank", "local_rank")


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _train(rec: dict, rank: int) -> Iterator[tuple[str, str | None, Any]]:
    yield from (("llama_fp8_step", None, rec.get("step")), ("llama_fp8_train_loss", None, rec.get("loss")),
                ("llama_fp8_learning_rate", None, rec.get("lr")), ("llama_fp8_grad_norm", None, rec.get("grad_norm")),
                ("llama_fp8_tokens_per_second", None, rec.get("tokens_per_sec")),
                ("llama_fp8_device_tokens_per_second", None, rec.get("tokens_per_sec_per_device")),
                ("llama_fp8_data_wait_ratio", None, rec.get("data_wait_frac")),
                ("llama_fp8_goodput_ratio", None, rec.get("goodput")))
    tflops = _num(rec.get("tflops_per_device"))
    yield "llama_fp8_device_flops_per_second", None, None if tflops is None else tflops * 1e12
    for peak in ("bf16", "fp8"):
        yield "llama_fp8_mfu_ratio", peak, rec.get(f"mfu_vs_{peak}_peak")
    if isinstance(rec.get("stragglers"), list):
        named = rec["stragglers"]
        yield "llama_fp8_straggler_rank", None, named[0].get("rank") if named else NO_STRAGGLER
        yield "llama_fp8_stragglers", None, len(named)
    ranks = rec.get("ranks")
    mine = ranks[rank] if isinstance(ranks, list) and 0 <= rank < len(ranks) and isinstance(ranks[rank], dict) else {}
    mem = _num(mine.get("mem_peak_gib", rec.get("mem_peak_gib") if rank == 0 else None))
    yield "llama_fp8_memory_high_water_bytes", None, None if mem is None else mem * GIB
    yield "llama_fp8_rank_step_seconds", None, mine.get("step_s")
    yield "llama_fp8_rank_data_wait_seconds", None, mine.get("data_wait_s")


def _fp8_stats(rec: dict, rank: int) -> Iterator[tuple[str, str | None, Any]]:
    for key, value in rec.items():
        if key.endswith("_underflow_max"):
            yield "llama_fp8_fp8_underflow_ratio", key.removesuffix("_underflow_max"), value
        elif key.endswith("_snr_db_min"):
            yield "llama_fp8_fp8_snr_decibels", key.removesuffix("_snr_db_min"), value


def info_labels(rec: dict) -> dict[str, str]:
    """The run's _info labels from a meta record (empty text where it has none)."""
    repro = rec.get("repro") if isinstance(rec.get("repro"), dict) else {}
    found = {**rec, "git_commit": repro.get("git_commit")}
    return {k: "" if found.get(k) is None else str(found[k]) for k in INFO_LABELS}


READERS: dict[str, Callable[[dict, int], Iterator[tuple[str, str | None, Any]]]] = {
    "train": _train,
    "val": lambda rec, rank: iter([("llama_fp8_validation_loss", None, rec.get("val_loss"))]),
    "goodput": lambda rec, rank: iter([("llama_fp8_goodput_ratio", None, rec.get("goodput"))]),
    "meta": lambda rec, rank: iter([("llama_fp8_restarts_total", None, rec.get("restarts"))]),
    "fp8_stats": _fp8_stats,
}


class Board:
    """The latest value of every gauge this rank exports, updated from the records as they are written."""

    def __init__(self, labels: dict[str, str], rank: int, local_rank: int, is_main: bool):
        assert set(labels) == set(JOB_LABELS), labels
        self.labels, self.rank, self.is_main = dict(labels), rank, is_main
        self.rank_labels = {**self.labels, "rank": str(rank), "local_rank": str(local_rank)}
        self.values: dict[tuple[str, str | None], float] = {}
        self.info: dict[str, str] | None = None  # llama_fp8_run_info's labels, from rank 0's meta record

    def update(self, rec: dict) -> bool:
        """Take a record's values; True when one changed (a value that is absent or not a number is skipped)."""
        read = READERS.get(rec.get("type"))
        changed = False
        if rec.get("type") == "meta" and self.is_main and info_labels(rec) != self.info:
            self.info, changed = info_labels(rec), True
        for name, extra, value in read(rec, self.rank) if read else ():
            value = _num(value)
            if value is None or not (self.is_main or BY_NAME[name].per_rank):
                continue
            old = self.values.get((name, extra))
            if old is None or not (old == value or (math.isnan(old) and math.isnan(value))):
                self.values[(name, extra)] = value
                changed = True
        return changed

    def samples(self) -> Iterator[tuple[Gauge, list[tuple[dict[str, str], float]]]]:
        """(gauge, [(labels, value), ...]) for every gauge with a value, in table order."""
        for gauge in GAUGES:
            if gauge.info:
                if self.info is not None:
                    yield gauge, [({**self.labels, **self.info}, 1.0)]
                continue
            found = [(extra, v) for (name, extra), v in self.values.items() if name == gauge.name]
            if not found:
                continue
            base = self.rank_labels if gauge.per_rank else self.labels
            yield gauge, [({**base, gauge.label: extra} if gauge.label else dict(base), v)
                          for extra, v in sorted(found, key=lambda x: x[0] or "")]


def table_markdown() -> str:
    """docs/metrics.md's table of the exported gauges."""
    rows = ["| metric | type | labels | what | from metrics.jsonl |", "|---|---|---|---|---|"]
    for g in GAUGES:
        labels = ", ".join((*JOB_LABELS, *(RANK_LABELS if g.per_rank else ()), *((g.label,) if g.label else ()),
                            *g.info))
        rows.append(f"| `{g.name}` | {'counter' if g.counter else 'gauge'} | {labels} | {g.help} | {g.source} |")
    return "\n".join(rows)
