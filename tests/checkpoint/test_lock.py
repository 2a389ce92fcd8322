"""One job per checkpoint folder: a second job is refused naming the holder; a stale lock (holder dead on
this host, or this same Slurm job requeued) is taken over; a lock of another host is never judged stale."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from ckpt_kit import run

from llama_fp8 import checkpoint as K
from llama_fp8.checkpoint import lock


def plant(ckpts, **holder) -> None:
    ckpts.mkdir(parents=True, exist_ok=True)
    (ckpts / lock.LOCK).write_text(json.dumps({"job_id": None, "host": socket.gethostname(), "since": "earlier",
                                               **holder}))


@pytest.mark.slow
def test_second_job_on_the_same_checkpoint_dir_is_refused_naming_the_holder(saved, capsys, monkeypatch, hostile):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        plant(saved / "checkpoints", job_id="4242", pid=other.pid)
        monkeypatch.setenv("SLURM_JOB_ID", "777")
        capsys.readouterr()
        assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 2
        err = capsys.readouterr().err
        assert "Slurm job 4242" in err and socket.gethostname() in err and f"pid {other.pid}" in err, err[-2000:]
        refused = err[err.find("is in use by"):][:90]
        assert [s for s, _ in K.complete_checkpoints(saved / "checkpoints")] == [2, 4]  # nothing touched
    finally:
        other.kill()
        other.wait()
    # its holder is gone now (same host, dead pid): the lock is stale and taken over, loudly
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    err = capsys.readouterr().err
    assert "taking over the lock" in err and "no longer running" in err, err[-2000:]
    assert [s for s, _ in K.complete_checkpoints(saved / "checkpoints")] == [4, 6]
    hostile(f"exit 2: \"...{refused}...\"; after the holder died: \"taking over the lock\", resumed")


def test_lock_of_another_host_is_not_judged_stale_and_says_how_to_remove_it(saved, capsys, hostile):
    plant(saved / "checkpoints", job_id="99", host="node-elsewhere", pid=1)
    capsys.readouterr()
    assert run(saved, "--max_steps", "6") == 2
    err = capsys.readouterr().err
    assert "node-elsewhere" in err and f"remove {saved / 'checkpoints' / 'LOCK'}" in err, err[-2000:]
    hostile("exit 2: \"... Slurm job 99 on host node-elsewhere ... if it is gone (its node died), remove "
            ".../LOCK and rerun\"")


def test_the_same_slurm_job_requeued_takes_its_lock_back(saved, capsys, monkeypatch, hostile):
    plant(saved / "checkpoints", job_id="555", host="node-before-requeue", pid=12345)
    monkeypatch.setenv("SLURM_JOB_ID", "555")
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    assert "same job 555" in capsys.readouterr().err
    hostile("\"taking over the lock ...: held by this same job 555 before a requeue or restart\"; exit 0")


@pytest.mark.slow
def test_lock_is_released_at_the_end_of_the_process(tmp_path):
    from ckpt_kit import BASE

    from helpers import run_cli

    r = run_cli(["train", *BASE, "--run_dir", str(tmp_path / "b"), "--max_steps", "1", "--checkpoint_freq", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (tmp_path / "b" / "checkpoints" / lock.LOCK).exists()
