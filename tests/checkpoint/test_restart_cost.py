"""What a restart inside the allocation costs: the checkpoint this job saved is read once, verified as it loads
(not a full check, then the load); the weights are not drawn at random before the load overwrites them. Both keep
the resumed run bit for bit the uninterrupted one's."""

from __future__ import annotations

import json

import pytest
from ckpt_kit import ck, run

from helpers import train_records
from llama_fp8.checkpoint import manifest as M
from llama_fp8.checkpoint import resume
from llama_fp8.errors import EXIT_TRANSIENT
from llama_fp8.models import spec
from llama_fp8.telemetry import time_limit


def losses(b) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_records(b)}


@pytest.mark.slow
def test_the_checkpoint_this_job_saved_is_read_once_and_no_weight_is_drawn(saved, tmp_path, monkeypatch):
    """The launcher names step_4 as saved by this job: no start-up check (before: every file read and hashed once
    to check, then again to load), no random init of the weights; the losses after the resume are the
    uninterrupted run's."""
    ref = tmp_path / "ref"
    assert run(ref, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    checked, drawn = [], []
    real_verify, real_init = M.verify, spec.ModelImpl.init_weights
    monkeypatch.setattr(M, "verify", lambda *a, **k: checked.append(a[0]) or real_verify(*a, **k))
    monkeypatch.setattr(spec.ModelImpl, "init_weights", lambda *a, **k: drawn.append(1) or real_init(*a, **k))
    monkeypatch.setenv(resume.TRUSTED_ENV, "4")
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    assert checked == [] and drawn == []
    assert {s: v for s, v in losses(saved).items() if s > 4} == {s: v for s, v in losses(ref).items() if s > 4}
    monkeypatch.setenv(resume.TRUSTED_ENV, "2")  # not the latest: checked in full as before
    assert run(saved, "--max_steps", "8", "--checkpoint_freq", "2") == 0
    assert [p.name for p in checked] == ["step_6"]


@pytest.mark.slow
def test_a_saved_checkpoint_that_fails_its_load_is_checked_in_full_by_the_next_attempt(saved, monkeypatch, capsys):
    """A byte of step_4 flipped after the save: its trusted load refuses it (the load verifies what it uses), exit
    75, not 2 (the next attempt checks it in full and falls back to step_2), nothing set aside yet."""
    shard = ck(saved, 4) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    monkeypatch.setenv(resume.TRUSTED_ENV, "4")
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == EXIT_TRANSIENT
    err = capsys.readouterr().err
    assert "loaded without the start-up check" in err and "checks it in full" in err, err[-2000:]
    assert not (saved / "checkpoints" / "step_4.broken").exists()
    monkeypatch.delenv(resume.TRUSTED_ENV)
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    assert (saved / "checkpoints" / "step_4.broken").exists()


@pytest.mark.slow
def test_training_warns_when_the_lead_is_shorter_than_the_save(saved, monkeypatch, capsys):
    """Resuming from a checkpoint whose save took 300 s (its manifest says so) with a 120 s lead: warned at start.
    Then the first save of the attempt, measured, against a lead of 1 s: warned again, with the interval to use."""
    complete = saved / "checkpoints" / "step_4" / "COMPLETE"
    manifest = json.loads(complete.read_text())
    complete.write_text(json.dumps({**manifest, "save_s": 300.0}))
    monkeypatch.setenv(time_limit.LEAD_ENV, "120")
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    err = capsys.readouterr().err
    assert "a save takes 300 s (the save of step_4, as its manifest recorded)" in err, err[-2000:]
    monkeypatch.setenv(time_limit.LEAD_ENV, "1")
    monkeypatch.setenv(time_limit.LIMIT_ENV, "3600")
    assert run(saved, "--max_steps", "8", "--checkpoint_freq", "2") == 0
    err = capsys.readouterr().err
    assert "comes 1 s before the end" in err and "(the save of step_8)" in err and "--checkpoint_freq" in err, \
        err[-2000:]
    monkeypatch.setenv(time_limit.LEAD_ENV, "3600")  # long enough: nothing said
    assert run(saved, "--max_steps", "10", "--checkpoint_freq", "2") == 0
    assert "before the end" not in capsys.readouterr().err
