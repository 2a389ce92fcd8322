""""Saved" means complete: the manifest comes from what DCP wrote and is checked against DCP's metadata
before COMPLETE is written; a step folder without COMPLETE is named (never skipped or deleted without a
word); a transient I/O error during the check is retried; a checkpoint folder that cannot be listed stops
the run instead of starting it over."""

from __future__ import annotations

import errno
import pathlib

import pytest
from ckpt_kit import ck, run

from llama_fp8 import checkpoint as K
from llama_fp8.checkpoint import manifest as M
from llama_fp8.checkpoint import safe_io  # noqa: F401 - K.safe_io in tests


def test_manifest_lists_every_file_dcp_wrote_even_if_the_listing_misses_one(tmp_path, monkeypatch, hostile):
    real_glob = pathlib.Path.glob
    monkeypatch.setattr(pathlib.Path, "glob", lambda self, pattern: [p for p in real_glob(self, pattern)
                                                                     if not p.name.endswith(".distcp")])
    b = tmp_path / "b"
    assert run(b, "--max_steps", "2", "--checkpoint_freq", "2") == 0
    monkeypatch.undo()
    folder = ck(b, 2)
    assert "__0_0.distcp" in M.read_manifest(folder)["files"]
    assert K.verify(folder) == []
    hostile("COMPLETE lists __0_0.distcp; verify finds no problem")


def test_a_manifest_that_misses_a_file_of_the_metadata_fails_the_save(tmp_path, monkeypatch, capsys, hostile):
    real = K.Checkpointer._my_sums  # this rank's sums, one of them lost on the way to the manifest
    monkeypatch.setattr(K.Checkpointer, "_my_sums", lambda self, *a: {
        k: v for k, v in real(self, *a).items() if not k.endswith(".distcp")})
    b = tmp_path / "b"
    assert run(b, "--max_steps", "2", "--checkpoint_freq", "2") == 2
    err = capsys.readouterr().err
    assert "__0_0.distcp" in err and "not in the manifest" in err, err[-2000:]
    assert K.complete_checkpoints(b / "checkpoints") == []
    hostile(f"exit 2: \"...{err[err.find('does not cover'):][:180]}\"; no complete checkpoint")


@pytest.mark.slow
def test_step_folder_without_complete_is_named_and_kept(saved, capsys, hostile):
    stray = ck(saved, 6)
    stray.mkdir()
    (stray / "notes.txt").write_text("copied by hand, half done")
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    err = capsys.readouterr().err
    assert "step_6" in err and "no COMPLETE" in err, err[-2000:]
    kept = saved / "checkpoints" / "step_6.incomplete"
    assert (kept / "notes.txt").read_text() == "copied by hand, half done"  # set aside, not deleted
    assert [s for s, _ in K.complete_checkpoints(saved / "checkpoints")] == [4, 6]  # --keep_last_k 2
    hostile("warned \"step_6 has no COMPLETE marker\"; step_6.incomplete keeps its file; step_6 saved")


def test_transient_io_error_during_the_check_is_retried(saved, monkeypatch, capsys, hostile):
    real, failures = M.digest_file, []

    def flaky(path, *a, **kw):
        if path.name.endswith(".distcp") and len(failures) < 2:
            failures.append(path)
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(M, "digest_file", flaky)
    monkeypatch.setattr(K.safe_io, "RETRIES", (0.01, 0.01, 0.01))
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    err = capsys.readouterr().err
    assert len(failures) == 2 and "retrying" in err and "IS DAMAGED" not in err, err[-2000:]
    assert not (saved / "checkpoints" / "step_4.broken").exists()
    hostile("2 retries logged; resumed from step_4; nothing set aside")
    assert [s for s, _ in K.complete_checkpoints(saved / "checkpoints")] == [4, 6]  # --keep_last_k 2


def test_checkpoint_dir_that_cannot_be_listed_stops_instead_of_starting_over(saved, monkeypatch, capsys, hostile):
    ckpts, real = saved / "checkpoints", pathlib.Path.iterdir

    def hidden(self):
        if self == ckpts:
            raise OSError(errno.EIO, "Input/output error", str(self))
        return real(self)

    monkeypatch.setattr(pathlib.Path, "iterdir", hidden)
    monkeypatch.setattr(K.safe_io, "RETRIES", (0.01,))
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 2
    err = capsys.readouterr().err
    assert str(ckpts) in err and "cannot be listed" in err, err[-2000:]
    monkeypatch.undo()
    assert [s for s, _ in K.complete_checkpoints(ckpts)] == [2, 4]
    hostile(f"exit 2: \"...{err[err.find('cannot be listed'):][:120]}\"; step_2, step_4 intact")


def test_a_deletion_in_progress_is_left_to_the_background_deleter_and_an_earlier_runs_is_swept(tmp_path):
    """``step_N.old`` is deleted in the background; a save must not delete it again on the training thread (it
    held up an async save by the whole deletion on rank 0). Leftovers of an earlier run go at its first save."""
    from llama_fp8.checkpoint import Checkpointer

    ckpt = tmp_path / "checkpoints"
    (ckpt / "step_1.old").mkdir(parents=True)
    (ckpt / "step_0.tmp").mkdir()
    run_ckpt = Checkpointer(ckpt, 1, False, 0, 1)
    run_ckpt._prepare(ckpt / "step_3.tmp")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_3.tmp"]  # an earlier run's leftovers: swept
    (ckpt / "step_2.old").mkdir()  # this run's, being deleted in the background
    run_ckpt._prepare(ckpt / "step_4.tmp")
    assert (ckpt / "step_2.old").is_dir()
    Checkpointer(ckpt, 1, False, 0, 1)._prepare(ckpt / "step_5.tmp")  # the next run's first save
    assert not (ckpt / "step_2.old").exists()


@pytest.mark.parametrize("async_save", ["0", "1"])
def test_a_save_completes_when_dcp_returns_metadata_without_its_storage_data(tmp_path, monkeypatch, async_save):
    """torch 2.11's FileSystemWriter.finish fills a copy of DCP's metadata (``dataclasses.replace``), so the
    Metadata ``dcp.save`` returns has ``storage_data=None``. On a GPU node with torch 2.11 every save failed
    with "AttributeError: 'NoneType' object has no attribute 'values'"; the shard names then come from the
    .metadata file DCP wrote."""
    import dataclasses

    from torch.distributed.checkpoint import filesystem

    real = filesystem._FileSystemWriter.finish
    monkeypatch.setattr(filesystem._FileSystemWriter, "finish",
                        lambda self, metadata, results: real(self, dataclasses.replace(metadata), results))
    b = tmp_path / "b"
    assert run(b, "--max_steps", "2", "--checkpoint_freq", "2", "--async_checkpoint", async_save) == 0
    folder = ck(b, 2)
    assert "__0_0.distcp" in M.read_manifest(folder)["files"]
    assert K.verify(folder) == []
