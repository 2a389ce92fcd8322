"""Damaged and tampered checkpoints (1 rank, in-process): ``--resume_from_checkpoint auto`` names the
broken file, sets the checkpoint aside and resumes from the previous sound one; a checkpoint named
explicitly is never swapped for another; nothing read from a checkpoint executes code."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from faultkit import RUN, SMALL, assert_matches_reference, complete, last_step, run1, starts

from helpers import train_records
from llama_fp8 import checkpoint as K


@pytest.fixture
def saved(tmp_path):
    """A run stopped after step 4: complete checkpoints step_2 and step_4."""
    b = tmp_path / "b"
    assert run1(b, [*SMALL, "--max_steps", "4", "--checkpoint_freq", "2"]) == 0
    return b


def ck(b, step: int):
    return b / "checkpoints" / f"step_{step}"


def truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def garble(path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


DAMAGE = {
    "truncated shard": ("__0_0.distcp", truncate),
    "flipped byte in shard": ("__0_0.distcp", flip_byte),
    "missing shard": ("__0_0.distcp", lambda p: p.unlink()),
    "truncated .metadata": (".metadata", truncate),
    "garbled train_state.json": ("train_state.json", truncate),
    "garbled rank file": ("rank0.safetensors", garble),
    "garbled COMPLETE": ("COMPLETE", lambda p: p.write_text('{"format": "llama-fp8 check')),
}


def resume_and_check(b, ref1, capsys) -> tuple[str, str]:
    """Rerun to the end; it must resume from step_2 and match the uninterrupted run. Returns (stderr,
    the observation)."""
    capsys.readouterr()
    assert run1(b, RUN) == 0
    err = capsys.readouterr().err
    assert starts(b)[-1] == 2
    return err, assert_matches_reference(b, ref1, 2)


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.slow
def test_damaged_latest_checkpoint_falls_back(saved, ref1, capsys, row, damage):
    name, how = DAMAGE[damage]
    how(ck(saved, 4) / name)
    err, same = resume_and_check(saved, ref1, capsys)
    warning = [ln for ln in err.splitlines() if "IS DAMAGED" in ln]
    assert len(warning) == 1 and str(ck(saved, 4) / name) in warning[0], err[-3000:]
    assert (saved / "checkpoints" / "step_4.broken").is_dir()  # kept for inspection, not deleted
    assert complete(saved) == [4, 6]  # step_4 trained again and saved again; the broken one set aside
    problem = warning[0].split(": ", 1)[1].split(". Trying")[0]
    row(f"warning: \"{problem[problem.find('/step_4/') + 1:][:160]}\"; set aside as step_4.broken; {same}", 2)


@pytest.mark.slow
def test_every_checkpoint_damaged_stops(saved, capsys, row):
    truncate(ck(saved, 4) / "__0_0.distcp")
    flip_byte(ck(saved, 2) / "__0_0.distcp")
    capsys.readouterr()
    assert run1(saved, RUN) == 2
    err = capsys.readouterr().err
    assert "no sound checkpoint to resume from" in err and "step_4, step_2" in err, err[-2000:]
    assert "M parameters" not in err and len(train_records(saved)) == 4  # not built, nothing appended
    assert sorted(p.name for p in (saved / "checkpoints").iterdir()) == ["step_2.broken", "step_4.broken"]
    row("exit 2 before building: \"no sound checkpoint to resume from ... (step_4, step_2; renamed *.broken)\"; "
        "every file kept", None)


@pytest.mark.slow
def test_explicitly_named_damaged_checkpoint_stops(saved, capsys, row):
    flip_byte(ck(saved, 4) / "__0_0.distcp")
    capsys.readouterr()
    assert run1(saved, [*RUN, "--resume_from_checkpoint", str(ck(saved, 4))]) == 2
    err = capsys.readouterr().err
    assert f"--resume_from_checkpoint {ck(saved, 4)}: the checkpoint is damaged" in err, err[-2000:]
    assert f"{ck(saved, 4)}/__0_0.distcp: checksum" in err
    assert complete(saved) == [2, 4] and len(train_records(saved)) == 4  # nothing renamed, nothing appended
    row("exit 2 before building, naming __0_0.distcp and its checksum mismatch; step_2 not used in its place", None)


# --- files that would run code -----------------------------------------------------------------------------
class Payload:
    """Unpickling calls os.system: what a tampered checkpoint file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def to_old_format(step_dir) -> None:
    """Rewrite a checkpoint as the previous version wrote it: rank0.pt (torch.save pickle), COMPLETE = ok."""
    from llama_fp8.checkpoint import files as F

    state = F.read_rank_state(step_dir / "rank0.safetensors")
    torch.save(state, step_dir / "rank0.pt")
    (step_dir / "rank0.safetensors").unlink()
    (step_dir / "COMPLETE").write_text("ok\n")


def forge_manifest(step_dir) -> None:
    """Rewrite the manifest to match the files as they are now (what an attacker with write access can do)."""
    from llama_fp8.checkpoint import manifest

    man = json.loads((step_dir / "COMPLETE").read_text())
    for name in man["files"]:
        size, digest = manifest.digest_file(step_dir / name)
        man["files"][name] = {"bytes": size, manifest.ALGORITHM: digest}
    (step_dir / "COMPLETE").write_text(json.dumps(man))


@pytest.mark.slow
def test_planted_pickle_in_legacy_rank_file_is_refused(saved, ref1, tmp_path, capsys, row):
    from llama_fp8.checkpoint import files as F

    marker = tmp_path / "payload_ran"
    for step in (2, 4):
        to_old_format(ck(saved, step))
    torch.save({"loader": Payload(marker), "rng": {}}, ck(saved, 4) / "rank0.pt")
    with pytest.raises(F.UnsafeCheckpointFile, match="refused"):
        F.read_legacy_rank_state(ck(saved, 4) / "rank0.pt")
    err, same = resume_and_check(saved, ref1, capsys)
    assert not marker.exists(), "the planted payload ran"
    warning = next(ln for ln in err.splitlines() if "IS DAMAGED" in ln)
    assert "rank0.pt: refused" in warning and "system" in warning, warning
    row(f"payload not run; \"{warning.split('/step_4/')[1][:150]}...\"; {same}", 2)


@pytest.mark.slow
def test_planted_pickle_in_dcp_metadata_is_refused(saved, ref1, tmp_path, capsys, row):
    from llama_fp8.checkpoint import dcp_read as D
    from llama_fp8.checkpoint import files as F

    marker = tmp_path / "payload_ran"
    (ck(saved, 4) / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    forge_manifest(ck(saved, 4))
    with pytest.raises(F.UnsafeCheckpointFile, match="refused: global posix.system is not allowed"):
        D.read_dcp_metadata(ck(saved, 4))
    err, same = resume_and_check(saved, ref1, capsys)
    assert not marker.exists(), "the planted payload ran"
    assert "global posix.system is not allowed in DCP metadata" in err
    row(f"payload not run; \".metadata: refused: global posix.system is not allowed in DCP metadata\"; {same}", 2)


def test_planted_pickle_as_rank_file_with_forged_manifest_is_refused(saved, ref1, tmp_path, capsys, row):
    marker = tmp_path / "payload_ran"
    torch.save({"loader": Payload(marker)}, ck(saved, 4) / "rank0.safetensors")
    forge_manifest(ck(saved, 4))
    err, same = resume_and_check(saved, ref1, capsys)
    assert not marker.exists(), "the planted payload ran"
    warning = next(ln for ln in err.splitlines() if "IS DAMAGED" in ln)
    assert "rank0.safetensors: is not a valid per-rank state file" in warning, warning
    row(f"payload not run; \"rank0.safetensors: is not a valid per-rank state file\"; {same}", 2)


@pytest.mark.slow
def test_old_format_checkpoint_still_resumes_bitwise(saved, ref1, capsys, row):
    for step in (2, 4):
        to_old_format(ck(saved, step))
    assert K.verify(ck(saved, 4)) == []
    capsys.readouterr()
    assert run1(saved, RUN) == 0
    assert starts(saved)[-1] == 4 and last_step(saved) == 6
    row(assert_matches_reference(saved, ref1, 4), 0)
