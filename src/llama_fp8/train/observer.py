"""The loop's bookkeeping, called at named moments so that the loop reads as the step: the launcher's heartbeat
(telemetry/heartbeat.py), goodput's clock (telemetry/goodput.py), per-rank step timing for the straggler report
(telemetry/stragglers.py), the profiler's schedule, the precision runtime's records (the FP8 check, per-layer
statistics), the logging window's record and the fault point at the end of a run.

Host-side only: nothing here reads the device except ``log`` (a logging step's one sync)."""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from llama_fp8 import faults
from llama_fp8.data import combine_fingerprints
from llama_fp8.telemetry import goodput, heartbeat, metrics, profiling, sinks, stragglers, swaps

log = logging.getLogger("llama_fp8.train")


class RunObserver:
    def __init__(self, *, heartbeat: heartbeat.Heartbeat, clock: goodput.Goodput, ranks: stragglers.RankMonitor,
                 profiler: profiling.Profiler, meter: metrics.StepMeter, writer: sinks.MetricsWriter,
                 precision, precision_name: str, world_size: int, is_main: bool, start_step: int,
                 lead=None, readers_per_batch: int = 1):
        self.heartbeat, self.clock, self.ranks, self.profiler = heartbeat, clock, ranks, profiler
        self.meter, self.writer, self.precision = meter, writer, precision
        self.precision_name, self.world_size, self.is_main = precision_name, world_size, is_main
        self._window_start = start_step + 1  # the first step of the logging window in progress
        self._t_step = 0.0
        self._data_wait = 0.0
        self._step_s: float | None = None
        self.lead = lead  # telemetry/time_limit.LeadCheck (rank 0, when the job knows its --signal lead)
        self.readers_per_batch = readers_per_batch  # ranks that read each batch: a tensor/context-parallel group
        self._swaps = swaps.pending() if is_main else []  # a spare took a node's place before this attempt

    def begin(self) -> None:
        """The loop starts: start-up ends here."""
        self.clock.begin()
        if self.is_main:
            log.info("%s", goodput.startup.line())
        faults.at("startup", self._window_start - 1)

    def step_begins(self, step: int) -> None:
        self.heartbeat.beat(step, "step")
        self.profiler.before_step(step)
        self._t_step = time.perf_counter()

    def fetching(self):
        """Around a fetch from the data loader: a long wait is shown to the launcher as the phase ``data``."""
        return self.heartbeat.data_wait()

    def step_ends(self, step: int, loss: torch.Tensor, data_wait: float) -> None:
        """The optimizer step and the LR schedule's step are done (``loss`` stays on the device)."""
        self._step_s = time.perf_counter() - self._t_step
        self.ranks.add_step(self._step_s, data_wait)
        self._data_wait = data_wait
        self.profiler.after_step(step)
        self.meter.add_step(loss, data_wait)
        self.precision.report(self.writer, step)  # FP8 check / statistics records, when the runtime has any

    def log(self, step: int, lr: float, grad_norm: torch.Tensor | None, data_sum: int,
            data_tokens: dict[str, int] | None = None) -> float:
        """A logging step: the window's record and a warning that names stragglers. Every rank makes the record (its
        all-reduced loss, every rank's step time, data wait, memory and data fingerprint); rank 0's writer writes it
        everywhere, each rank's writer exports its per-rank gauges from it (telemetry/outputs.py). ``data_sum``: this
        rank's ``data.Fingerprinted.take()``; ``data_tokens``: the tokens read from each source so far (a tokenized
        corpus's loader knows them for every rank). Returns the window's loss."""
        rec = self.meter.window(step, lr, grad_norm)
        ranks = self.ranks.window(rec["mem_peak_gib"], data_sum)
        # every sample the window's steps read, all data-parallel ranks together: equal in two runs iff they read the
        # same data, whatever their world sizes
        rec.update(precision=self.precision_name, world_size=self.world_size,
                   data_crc32=combine_fingerprints(ranks.pop("data_sums"), self.readers_per_batch),
                   data_from_step=self._window_start, goodput=self.clock.so_far(), **ranks)
        if data_tokens is not None:
            rec["data_tokens"] = data_tokens
        self._window_start = step + 1
        self.writer.write(rec, metrics.format_line(rec))
        note = stragglers.summary_line(rec["stragglers"])
        if note and self.is_main:
            log.warning("step %d: %s", step, note)
        return rec["loss"]

    @contextlib.contextmanager
    def evaluating(self, step: int):
        self.heartbeat.beat(step, "eval")
        with self.clock.timed("evaluation"):
            yield

    @contextlib.contextmanager
    def saving(self, step: int):
        """A checkpoint save; counted when it returns."""
        self.heartbeat.beat(step, "save")
        with self.clock.timed(self.clock.checkpoint_part):
            yield
        self.clock.saves += 1
        if self.lead is not None:  # is the time limit's lead long enough for this save?
            self.lead.after_save(step, self._step_s)

    def waiting_for_save(self):
        """Waiting for an async save to be written (charged to checkpointing, not to a step)."""
        return self.clock.timed(self.clock.checkpoint_part)

    def step_closed(self, step: int) -> None:
        """The step with its logging, evaluation and save is over: goodput's clock closes it. The attempt's first
        step after a swap to a spare node: its records (telemetry/swaps.py)."""
        self.clock.end_step(step, self._data_wait)
        for swap in self._swaps:
            rec = swaps.record(swap, step)
            self.writer.write(rec)
            log.warning("%s", swaps.line(rec))
        self._swaps = []

    def stopped_by_signal(self) -> None:
        self.clock.ended = "signal"

    def finished(self, step: int) -> None:
        """The last step is done and its checkpoint complete. From here a rank that dies (a segfault in teardown)
        loses nothing: the launcher does not restart the job."""
        self.clock.ended = "finished"
        self.heartbeat.beat(step, "finished")
        faults.at("finished", step)

    def out_of_memory(self) -> None:
        self.profiler.dump_snapshot("oom")  # with --memory_snapshot 1: what filled the memory

    def close(self) -> None:
        """The attempt's goodput record (when the loop began), then the profiler's last trace."""
        if self.clock.begun:
            rec = self.clock.record()
            self.writer.write(rec, goodput.summary_line(rec))
        self.profiler.close()
        self.ranks.close()
