"""Running real training jobs with injected faults, and reading what they left behind.

Every matrix test runs the real CLI: 2 ranks under ``llama-fp8 launch`` (torchrun that keeps the workers'
exit code, as the sbatch script runs it) or one rank in-process, on the smaller-than-tiny model. Faults
are injected through ``LLAMA_FP8_FAULT`` (src/llama_fp8/faults/inject.py) at exact points, or from outside
with signals and file damage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from helpers import REPO, cli_env, read_metrics, train_records, worker_pids
from llama_fp8 import checkpoint as K
from llama_fp8 import config as C
from llama_fp8 import train as T

SMALL = ["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
         "--train_batch_size", "2", "--logging_freq", "1", "--lr_decay_iters", "8", "--seed", "3"]
STEPS, FREQ = 6, 2  # the matrix run: 6 steps, a checkpoint every 2 (step_2, step_4, step_6)
RUN = [*SMALL, "--max_steps", str(STEPS), "--checkpoint_freq", str(FREQ)]


@dataclass
class Result:
    rc: int
    out: str
    err: str
    seconds: float


def launch(run_dir: Path, args: list[str], nproc: int = 2, fault: str | None = None,
           fault_dir: Path | None = None, preexec_fn=None) -> subprocess.Popen:
    """Start a training job of ``nproc`` ranks (``llama-fp8 launch``); ``fault``: LLAMA_FP8_FAULT;
    ``preexec_fn`` runs in the child before it starts (limits it sets are inherited by the ranks)."""
    extra = {}
    if fault:
        extra["LLAMA_FP8_FAULT"] = fault
    if fault_dir:
        extra["LLAMA_FP8_FAULT_DIR"] = str(fault_dir)
    cmd = [sys.executable, "-m", "llama_fp8", "launch", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "llama_fp8", "train", *args, "--run_dir", str(run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(**extra),
                            cwd=REPO, preexec_fn=preexec_fn)


def finish(p: subprocess.Popen, t0: float, timeout: float = 240) -> Result:
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        p.kill()
    return Result(p.returncode, out, err, time.monotonic() - t0)


def run2(run_dir: Path, args: list[str], nproc: int = 2, fault: str | None = None, fault_dir: Path | None = None,
         timeout: float = 240) -> Result:
    t0 = time.monotonic()
    return finish(launch(run_dir, args, nproc, fault, fault_dir), t0, timeout)


def run1(run_dir: Path, args: list[str]) -> int:
    """One rank, in this process (a process group of one): seconds instead of tens of seconds."""
    return T.run(C.parse_args([*args, "--run_dir", str(run_dir)]))


def signal_ranks(p: subprocess.Popen, sig: int) -> list[int]:
    pids = worker_pids(p.pid)
    for pid in pids.values():
        os.kill(pid, sig)
    return sorted(pids)


# --- what a run left behind --------------------------------------------------------------------------
def complete(run_dir: Path) -> list[int]:
    return [s for s, _ in K.complete_checkpoints(run_dir / "checkpoints")]


def leftovers(run_dir: Path) -> list[str]:
    """What a checkpoint folder holds besides complete checkpoints (not the LOCK a killed job leaves behind:
    the next run takes that over, see tests/checkpoint/test_lock.py)."""
    d = run_dir / "checkpoints"
    return sorted(p.name for p in d.iterdir() if not p.name.startswith(".") and p.name not in
                  {f"step_{s}" for s in complete(run_dir)} | {"LOCK"}) if d.is_dir() else []


def losses(run_dir: Path) -> dict[int, float]:
    """Loss by step; a step trained twice (before a fault and after the resume) keeps its last value."""
    return {r["step"]: r["loss"] for r in train_records(run_dir)}


def last_step(run_dir: Path) -> int:
    recs = train_records(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    return max((r["step"] for r in recs), default=0)


def starts(run_dir: Path) -> list[int]:
    return [r["start_step"] for r in read_metrics(run_dir) if r["type"] == "meta"]


def shard_sums(step_dir: Path) -> dict[str, str]:
    """CRC32 of the model/optimizer shards (read here, not taken from the manifest under test): equal sums =
    bitwise equal weights and optimizer moments (DCP writes the same state into the same bytes)."""
    return {p.name: f"{zlib.crc32(p.read_bytes()):08x}" for p in sorted(step_dir.glob("*.distcp"))}


@dataclass
class Reference:
    """The uninterrupted run every resumed run is compared with."""

    run_dir: Path
    losses: dict[int, float]
    final: dict[str, str]
    wall_s: float | None = None  # a Slurm job's start-to-end time (the faulted jobs are compared with it)


def reference(run_dir: Path, nproc: int) -> Reference:
    if nproc == 1:
        assert run1(run_dir, RUN) == 0
    else:
        r = run2(run_dir, RUN, nproc)
        assert r.rc == 0, r.err[-3000:]
    return Reference(run_dir, losses(run_dir), shard_sums(run_dir / "checkpoints" / f"step_{STEPS}"))


def assert_matches_reference(run_dir: Path, ref: Reference, resumed_from: int) -> str:
    """The resumed run ends exactly where the uninterrupted one did: same losses after the resume point,
    bitwise the same final model and optimizer state. Returns the observation for the matrix."""
    got = losses(run_dir)
    after = range(resumed_from + 1, STEPS + 1)
    assert [got[s] for s in after] == [ref.losses[s] for s in after], (got, ref.losses)
    assert shard_sums(run_dir / "checkpoints" / f"step_{STEPS}") == ref.final
    steps = f"step {STEPS}" if after.start == STEPS else f"steps {after.start}-{STEPS}"
    where = f"resumed from step_{resumed_from}; losses of {steps}" if resumed_from else f"losses of {steps}"
    return f"{where} and final weights bitwise equal to the uninterrupted run"


def exit_text(rc: int) -> str:
    """``llama-fp8 launch`` returns 128 + N when a rank died of signal N (as a shell reports it)."""
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    if rc > 128 and rc - 128 in {s.value for s in signal.Signals}:
        return f"exit {rc} (a rank died of {signal.Signals(rc - 128).name})"
    return f"exit {rc}"


def assert_matches_reference_s3(run_dir: Path, ref: Reference, resumed_from: int, final: dict[str, str]) -> str:
    """``assert_matches_reference`` for a run whose checkpoints are on S3: ``final`` are its last shards' sums."""
    got = losses(run_dir)
    after = range(resumed_from + 1, STEPS + 1)
    assert [got[s] for s in after] == [ref.losses[s] for s in after], (got, ref.losses)
    assert final == ref.final, (final, ref.final)
    steps = f"step {STEPS}" if after.start == STEPS else f"steps {after.start}-{STEPS}"
    return f"losses of {steps} and final weights bitwise equal to the uninterrupted run"
