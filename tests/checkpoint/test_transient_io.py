"""A file system that fails for a moment is not a damaged checkpoint and not a bad config: a checkpoint read is
retried in place; what still fails after the retries ends the run with exit 75 (the launcher restarts it), with
nothing set aside as broken and nothing deleted. Before, an EIO during the load ended the job with exit 2 ("a
restart would fail the same way"), and one during the start-up check set a sound checkpoint aside as damaged."""

from __future__ import annotations

import errno

import pytest
from ckpt_kit import ck, run

from helpers import train_records
from llama_fp8 import checkpoint as K
from llama_fp8.checkpoint import manifest as M
from llama_fp8.checkpoint import safe_io
from llama_fp8.errors import EXIT_TRANSIENT


def uninterrupted_losses(tmp_path) -> dict[int, float]:
    b = tmp_path / "ref"
    assert run(b, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    return {r["step"]: r["loss"] for r in train_records(b)}


@pytest.mark.slow
def test_an_eio_while_the_load_reads_a_shard_is_retried_in_place(saved, tmp_path, monkeypatch, capsys):
    """One EIO as the load reads the model/optimizer shard (fault injection at ``checkpoint.read``, once): the file
    is read again, the run resumes from step_4 and its losses are the uninterrupted run's."""
    monkeypatch.setattr(safe_io, "RETRIES", (0.01, 0.01, 0.01))
    monkeypatch.setenv("LLAMA_FP8_FAULT", "eio@checkpoint.read:once")
    monkeypatch.setenv("LLAMA_FP8_FAULT_DIR", str(tmp_path))
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    err = capsys.readouterr().err
    assert (tmp_path / "fired.checkpoint.read.rank0").exists(), "the fault never fired: the load read nothing?"
    assert "__0_0.distcp: Input/output error" in err and "retrying" in err, err[-2000:]
    assert "resumed from" in err and "step_4" in err
    monkeypatch.delenv("LLAMA_FP8_FAULT")
    ref = uninterrupted_losses(tmp_path)
    got = {r["step"]: r["loss"] for r in train_records(saved) if r["step"] > 4}
    assert got == {s: ref[s] for s in (5, 6)}


def test_an_eio_that_outlasts_the_retries_ends_with_exit_75_and_keeps_the_checkpoint(saved, tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.setattr(safe_io, "RETRIES", (0.01,))
    monkeypatch.setenv("LLAMA_FP8_FAULT", "eio@checkpoint.read")
    monkeypatch.setenv("LLAMA_FP8_FAULT_DIR", str(tmp_path))
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == EXIT_TRANSIENT
    err = capsys.readouterr().err
    assert "an I/O error" in err and "cannot load" in err and "exit 75" in err, err[-2000:]
    assert [s for s, _ in K.complete_checkpoints(saved / "checkpoints")] == [2, 4]
    assert not list((saved / "checkpoints").glob("*.broken"))
    assert K.verify(ck(saved, 4)) == []


def test_an_eio_that_outlasts_the_retries_of_the_check_sets_nothing_aside(saved, monkeypatch, capsys):
    """The start-up check cannot read the latest shard (EIO on every try): before, step_4 was renamed step_4.broken
    and the run fell back to step_2, as for a corrupted file. Now: exit 75, step_4 kept as it is."""
    real = M.digest_file

    def failing(path, *a, **kw):
        if path.name.endswith(".distcp") and path.parent.name == "step_4":
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(M, "digest_file", failing)
    monkeypatch.setattr(safe_io, "RETRIES", (0.01, 0.01))
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == EXIT_TRANSIENT
    err = capsys.readouterr().err
    assert "IS DAMAGED" not in err and "nothing was set aside" in err, err[-2000:]
    assert [s for s, _ in K.complete_checkpoints(saved / "checkpoints")] == [2, 4]


@pytest.mark.slow
def test_an_eio_during_a_save_is_transient_and_a_full_disk_is_not(tmp_path, monkeypatch, capsys):
    """A save that fails with EIO on a rank: exit 75 (restarted; the previous checkpoint stays the resume point).
    ENOSPC stays exit 2: a rerun into the same full disk fails the same way."""
    from llama_fp8.checkpoint import checkpointer

    for code, want in ((errno.EIO, EXIT_TRANSIENT), (errno.ENOSPC, 2)):
        real = checkpointer.Checkpointer._write_own

        def failing(self, tmp, step, *a, code=code, real=real):
            if step == 4:
                raise OSError(code, "injected", str(tmp))
            return real(self, tmp, step, *a)

        monkeypatch.setattr(checkpointer.Checkpointer, "_write_own", failing)
        b = tmp_path / f"b{code}"
        capsys.readouterr()
        assert run(b, "--max_steps", "6", "--checkpoint_freq", "2") == want, capsys.readouterr().err[-2000:]
        assert [s for s, _ in K.complete_checkpoints(b / "checkpoints")] == [2]
        monkeypatch.undo()


def test_an_eio_of_the_write_probe_is_transient(tmp_path, monkeypatch, capsys):
    """The probe is written by checkpoint/layout.py (since S3 places: checkpoint/places.py calls it for a folder);
    before, this test patched resume's open, which no longer writes the probe, and the run passed unprobed."""
    from llama_fp8.checkpoint import layout

    real_open = open

    def failing(path, *a, **kw):
        if ".write_probe." in str(path):
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(layout, "open", failing, raising=False)
    capsys.readouterr()
    assert run(tmp_path / "b", "--max_steps", "2", "--checkpoint_freq", "2") == EXIT_TRANSIENT
    err = capsys.readouterr().err
    assert "an I/O error" in err and "probe write" in err and "not writable" not in err, err[-2000:]


def test_the_manifest_records_how_long_the_save_took(saved):
    seconds = M.recorded_save_s(ck(saved, 4))
    assert seconds is not None and 0 < seconds < 120
