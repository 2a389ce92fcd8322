"""Signals in real 2-rank runs: repeated SIGUSR1, SIGTERM while an async save is in flight, a signal
during validation. Each must end in one clean checkpoint and the requeue exit code, and the rerun
must end exactly where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import time

import pytest
from faultkit import (
    SMALL,
    assert_matches_reference,
    complete,
    exit_text,
    finish,
    last_step,
    launch,
    leftovers,
    run2,
    starts,
)

from helpers import read_metrics, train_records, wait_for, worker_pids
from llama_fp8.config import EXIT_REQUEUE

pytestmark = pytest.mark.slow
LONG = [*SMALL, "--max_steps", "10000"]  # stopped by the signal; --lr_decay_iters 8 keeps the LRs of RUN


def rerun(b, ref, resumed_expected: int) -> str:
    r = run2(b, [*SMALL, "--max_steps", "6", "--checkpoint_freq", "2"])
    assert r.rc == 0, r.err[-3000:]
    assert starts(b)[-1] == resumed_expected
    return assert_matches_reference(b, ref, resumed_expected)


def paused(folder, point: str, ranks=(0, 1)) -> bool:
    return all((folder / f"paused.{point}.rank{r}").exists() for r in ranks)


def test_sigusr1_repeated(tmp_path, ref2, row):
    """Both ranks pause in the middle of step 3; SIGUSR1 to both, then every 50 ms until the job exits."""
    b, faults = tmp_path / "b", tmp_path / "faults"
    faults.mkdir()
    t0 = time.monotonic()
    p = launch(b, LONG, fault="pause@step:step=3", fault_dir=faults)
    try:
        wait_for(lambda: paused(faults, "step"), 180, "both ranks paused in step 3")
        pids, sent = worker_pids(p.pid), 0
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR1)
        (faults / "release").touch()
        while p.poll() is None and time.monotonic() - t0 < 180:  # keeps signalling through save and exit
            for pid in pids.values():
                try:
                    os.kill(pid, signal.SIGUSR1)
                    sent += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        r = finish(p, t0)
    finally:
        p.kill()
    assert r.rc == EXIT_REQUEUE, (r.rc, r.err[-3000:])
    assert complete(b) == [3] and not leftovers(b) and last_step(b) == 3
    assert "again: already stopping" in r.err
    same = rerun(b, ref2, 3)
    row(f"{exit_text(r.rc)} after {2 + sent} signals; step_3 saved; {same}", 0)


def test_sigterm_during_async_save(tmp_path, ref2, row):
    b, faults = tmp_path / "b", tmp_path / "faults"
    faults.mkdir()
    t0 = time.monotonic()
    p = launch(b, [*LONG, "--checkpoint_freq", "4", "--async_checkpoint", "1"],
               fault="pause@save.async_in_flight:step=4", fault_dir=faults)
    try:
        wait_for(lambda: paused(faults, "save.async_in_flight"), 180, "both ranks paused with the save in flight")
        for pid in worker_pids(p.pid).values():
            os.kill(pid, signal.SIGTERM)
        (faults / "release").touch()
        r = finish(p, t0)
    finally:
        p.kill()
    assert r.rc == EXIT_REQUEUE, (r.rc, r.err[-3000:])
    assert complete(b) == [4, 5] and not leftovers(b) and last_step(b) == 5
    same = rerun(b, ref2, 5)
    row(f"{exit_text(r.rc)}; step_4 (in flight) and step_5 complete; {same}", 0)


def test_signal_during_validation(tmp_path, ref2, row):
    """The train record of step 2 is written just before step 2's validation (400 batches, seconds):
    the signal is sent when it appears, so it lands during validation."""
    b = tmp_path / "b"
    t0 = time.monotonic()
    p = launch(b, [*LONG, "--validation_freq", "2", "--validation_batches", "400"])
    try:
        wait_for(lambda: (b / "metrics.jsonl").is_file() and last_step(b) >= 2, 180, "step 2 logged")
        for pid in worker_pids(p.pid).values():
            os.kill(pid, signal.SIGUSR1)
        r = finish(p, t0)
    finally:
        p.kill()
    assert r.rc == EXIT_REQUEUE, (r.rc, r.err[-3000:])
    vals = [x for x in read_metrics(b) if x["type"] == "val"]
    assert [v["step"] for v in vals] == [2] and [x["step"] for x in train_records(b)] == [1, 2]
    assert complete(b) == [2]  # saved at the step whose validation the signal interrupted
    same = rerun(b, ref2, 2)
    row(f"{exit_text(r.rc)}; validation of step 2 logged (loss {vals[0]['val_loss']:.3f}); step_2 saved; {same}", 0)
