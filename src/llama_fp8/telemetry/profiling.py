"""Where the time and the memory go: ``--profile_steps A:B`` (a torch.profiler trace of steps A..B) and
``--memory_snapshot 1`` (CUDA memory history, dumped for PyTorch's memory visualizer).

The trace records CPU and CUDA activities with Python stacks, so module calls appear by name
(``nn.Module: LlamaDecoderLayer_0``) next to the kernels, and our own phases are labelled
(``llama_fp8/forward``, ``llama_fp8/backward``, ``llama_fp8/optimizer``); open it in Perfetto
(ui.perfetto.dev) or chrome://tracing. Outside the profiled steps nothing is recorded or synced.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from llama_fp8.errors import ConfigError

log = logging.getLogger(__name__)
SNAPSHOT_ENTRIES = 200_000  # allocation events kept in the history (the visualizer's own example uses 100k)


def parse_steps(text: str, max_steps: int) -> tuple[int, int]:
    """``A:B`` -> (A, B), 1 <= A <= B <= max_steps; ConfigError naming the flag otherwise."""
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--profile_steps {text!r} is not valid; valid: A:B, two step numbers (e.g. 5:7)") from None
    if not 1 <= first <= last <= max_steps:
        raise ConfigError(f"--profile_steps {text}: need 1 <= A <= B <= --max_steps {max_steps}")
    return first, last


def parse_ranks(text: str) -> set[int] | None:
    """``0``, ``0,4``, or ``all`` (None)."""
    if text.strip() == "all":
        return None
    try:
        return {int(x) for x in text.split(",")}
    except ValueError:
        raise ConfigError(f"--profile_ranks {text!r} is not valid; valid: all, or comma-separated ranks") from None


def phase(name: str):
    """A labelled range in the trace (a no-op cost when no profiler runs)."""
    return torch.profiler.record_function(f"llama_fp8/{name}")


class Profiler:
    """Starts the trace before step A, stops and writes it after step B; records memory history throughout."""

    def __init__(self, cfg, run_dir: Path, rank: int, device: torch.device):
        self.dir = Path(run_dir) / "profile"
        self.rank, self.device = rank, device
        self.window = parse_steps(cfg.profile_steps, cfg.max_steps) if cfg.profile_steps else None
        ranks = parse_ranks(cfg.profile_ranks)
        self.tracing = self.window is not None and (ranks is None or rank in ranks)
        self.snapshot = bool(cfg.memory_snapshot)
        self._prof = None
        if self.snapshot:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)

    def before_step(self, step: int) -> None:
        if self.tracing and step == self.window[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True)
            self._prof.start()

    def after_step(self, step: int) -> None:
        if self._prof is not None and step == self.window[1]:
            self._write(f"steps{self.window[0]}-{self.window[1]}")

    def _write(self, label: str) -> Path:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"trace_rank{self.rank}_{label}.json"
        self._prof.export_chrome_trace(str(path))
        self._prof = None
        log.info("profiler trace: %s", path)
        return path

    def dump_snapshot(self, reason: str) -> Path | None:
        if not self.snapshot:
            return None
        path = self.dir / f"memory_rank{self.rank}_{reason}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        log.info("CUDA memory snapshot (%s): %s (open it at pytorch.org/memory_viz)", reason, path)
        return path

    def close(self) -> None:
        if self._prof is not None:  # stopped inside the window (a signal, an error): keep what was recorded
            with contextlib.suppress(Exception):
                self._write("partial")
            self._prof = None
        if self.snapshot:
            self.dump_snapshot("end")
            torch.cuda.memory._record_memory_history(enabled=None)
