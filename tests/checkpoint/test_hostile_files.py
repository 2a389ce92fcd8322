"""Checkpoint files written by an attacker or left by a flaky file system: a pickle that mutates a class, names
that leave the folder or name device files, oversized files, bytes changed between the check and the load,
forged fields. Each is refused with a message naming the file, and leaves the process as it was."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import threading

import pytest
from ckpt_kit import ck, run

from llama_fp8 import checkpoint as K
from llama_fp8.checkpoint import dcp_read as D
from llama_fp8.checkpoint import manifest as M
from llama_fp8.checkpoint import resume as R


def add_to_manifest(folder, name: str, data: bytes) -> None:
    """Forge the manifest so that it lists ``name`` with the size and checksum of ``data``."""
    man = json.loads((folder / "COMPLETE").read_text())
    h = M.HASHERS[M.ALGORITHM]()
    h.update(data)
    man["files"][name] = {"bytes": len(data), M.ALGORITHM: h.hexdigest()}
    (folder / "COMPLETE").write_text(json.dumps(man))


def reseal(folder, name: str) -> None:
    """Forge the manifest entry of ``name`` to match the file as it is now."""
    add_to_manifest(folder, name, (folder / name).read_bytes())


def verify_in_time(folder, seconds: float = 30) -> list[str]:
    """K.verify in a daemon thread: a check that hangs (reading a FIFO or /dev/zero) fails the test."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(K.verify(folder)), daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"verify of {folder} did not return within {seconds} s (hangs on a hostile entry)"
    return out[0]


# --- 1. the metadata unpickler cannot change the process -------------------------------------------------
_SHARED = {
    # BUILD with a (None, slots) state on an allowed class: setattr on the class itself
    "class attribute": (b"cpathlib\nPosixPath\nN(Vpwned\nI1\nd\x86b.", lambda: pathlib.PosixPath, "pwned"),
    # BUILD with a dict state on an allowed function: its __dict__, shared by the process
    "function attribute": (b"ctorch.serialization\n_get_layout\n(Vpwned\nI1\ndb.",
                           lambda: __import__("torch").serialization._get_layout, "pwned"),
    # an enum member (a process-wide singleton) made by REDUCE, then BUILD on it
    "enum member": (b"ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n(I1\ntR(Vpwned\nI1\ndb.",
                    lambda: __import__("torch").distributed.checkpoint.metadata._MEM_FORMAT_ENCODING(1), "pwned"),
    # the change made first, the refusal after (a refused pickle must not keep its change)
    "change then refused global": (b"cpathlib\nPurePosixPath\nN(Vpwned\nI1\nd\x86b0cposix\nsystem\n.",
                                   lambda: pathlib.PurePosixPath, "pwned"),
    # SETITEM on an object that is not a container this load made (the class's own mapping)
    "setitem on a class": (b"ccollections\nOrderedDict\nVpwned\nI1\ns.", lambda: __import__("collections")
                           .OrderedDict, "pwned"),
}


@pytest.mark.parametrize("attack", list(_SHARED))
def test_metadata_pickle_cannot_change_a_shared_object(tmp_path, attack, hostile):
    blob, target, attr = _SHARED[attack]
    (tmp_path / ".metadata").write_bytes(blob)
    try:
        with pytest.raises(K.UnsafeCheckpointFile, match=r"\.metadata: ") as e:
            D.read_dcp_metadata(tmp_path)
        assert not hasattr(target(), attr), f"{attack}: the refused load changed {target()!r} for the process"
        hostile(f"\"{e.value.reason}\"; {attr!r} not set afterwards")
    finally:
        for obj in (target(),):
            try:
                delattr(obj, attr)
            except (AttributeError, TypeError):
                pass


def test_metadata_of_a_real_checkpoint_still_loads_through_the_strict_unpickler(saved):
    with open(ck(saved, 4) / ".metadata", "rb") as f:
        want = pickle.load(f)  # our own file, read the unsafe way once for the comparison
    got = D.read_dcp_metadata(ck(saved, 4))
    assert got.state_dict_metadata == want.state_dict_metadata and got.storage_data == want.storage_data


# --- 2. names stay inside the folder; only regular files; sizes capped -------------------------------------
def _outside_file(folder):
    target = folder.parent.parent / "outside.bin"
    target.write_bytes(b"secret outside the checkpoint folder")
    return target


HOSTILE_NAMES = {
    "absolute path": lambda f: (str(_outside_file(f)), _outside_file(f).read_bytes()),
    "dot-dot": lambda f: ("../../outside.bin", _outside_file(f).read_bytes()),
    "symlink out": lambda f: (os.symlink(_outside_file(f), f / "link.bin") or "link.bin",
                              _outside_file(f).read_bytes()),
    "/dev/zero": lambda f: ("/dev/zero", b""),
    "symlink to /dev/zero": lambda f: (os.symlink("/dev/zero", f / "zero.bin") or "zero.bin", b""),
    "FIFO": lambda f: (os.mkfifo(f / "fifo.bin") or "fifo.bin", b""),
    "directory": lambda f: ((f / "sub.bin").mkdir() or "sub.bin", b""),
}


@pytest.mark.parametrize("attack", list(HOSTILE_NAMES))
def test_manifest_entries_outside_the_folder_or_not_regular_files_are_refused(saved, attack, hostile):
    folder = ck(saved, 4)
    name, data = HOSTILE_NAMES[attack](folder)
    add_to_manifest(folder, name, data)
    problems = verify_in_time(folder)
    assert problems and any(name in p or name.split("/")[-1] in p for p in problems), problems
    assert any(w in " ".join(problems) for w in ("not a plain file name", "symbolic link", "not a regular file")), \
        problems
    hostile(f"\"{problems[0][:240]}\"")


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/hostname", "sub/__0_0.distcp"])
def test_dcp_storage_paths_outside_the_folder_are_refused(saved, where, hostile):
    folder = ck(saved, 4)
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)
    info = next(iter(meta.storage_data.values()))
    info.relative_path = where
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    reseal(folder, ".metadata")
    with pytest.raises(K.UnsafeCheckpointFile, match="points outside the checkpoint folder") as e:
        D.read_dcp_metadata(folder)
    assert any("outside the checkpoint folder" in p for p in verify_in_time(folder))
    hostile(f"\"{e.value.reason[:200]}\"")


@pytest.mark.parametrize("name", ["COMPLETE", "train_state.json"])
def test_oversized_json_files_are_refused_without_reading_them(saved, name, hostile):
    folder = ck(saved, 4)
    huge = 2 << 30 if name == "COMPLETE" else 80 << 20
    with open(folder / name, "r+b") as f:
        f.truncate(huge)  # sparse: costs no disk
    if name != "COMPLETE":
        man = json.loads((folder / "COMPLETE").read_text())
        man["files"][name] = {"bytes": huge}  # no checksum: the size cap alone must refuse it
        (folder / "COMPLETE").write_text(json.dumps(man))
    problems = verify_in_time(folder)
    assert any(name in p and "more than" in p for p in problems), problems
    hostile(f"\"{next(p for p in problems if 'more than' in p).split('step_4/')[-1][:200]}\"")


# --- 3. what is checked is what is loaded ------------------------------------------------------------------
def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _flip_middle_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name,change", [
    pytest.param("__0_0.distcp", _flip_middle_byte, id="shard"),
    pytest.param("rank0.safetensors", _flip_last_byte, id="rank file"),
    pytest.param("train_state.json", lambda p: p.write_text(p.read_text().replace('"step": 4', '"step": 3')),
                 id="train_state.json")])
def test_bytes_changed_between_the_check_and_the_load_are_refused(saved, monkeypatch, capsys, name, change, hostile):
    real = R.check_compatible

    def check_then_change(path, *a, **kw):  # runs after the checksum pass, before the model is loaded
        real(path, *a, **kw)
        change(path / name)

    monkeypatch.setattr(R, "check_compatible", check_then_change)
    capsys.readouterr()
    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 2
    err = capsys.readouterr().err
    assert f"step_4/{name}" in err and "changed since it was checked" in err, err[-2000:]
    assert [s for s, _ in K.complete_checkpoints(saved / "checkpoints")] == [2, 4]  # nothing deleted
    line = next(ln for ln in err.splitlines() if "changed since it was checked" in ln)
    hostile(f"exit 2: \"{line[line.find('step_4/' + name):][:220]}\"")


# --- 5. forged fields: a clear error naming the file and the field ---------------------------------------
@pytest.mark.parametrize("field,value", [pytest.param("world_size", "two", id="world_size"),
                                         pytest.param("step", -3, id="step"),
                                         pytest.param("scheduler", [1, 2], id="scheduler"),
                                         pytest.param("config", "not a mapping", id="config")])
def test_forged_train_state_field_is_named(saved, capsys, field, value, hostile):
    for step in (2, 4):  # every checkpoint forged: auto has nothing to fall back to
        folder = ck(saved, step)
        state = json.loads((folder / "train_state.json").read_text())
        state[field] = value
        (folder / "train_state.json").write_text(json.dumps(state))
        reseal(folder, "train_state.json")
    capsys.readouterr()
    assert run(saved, "--max_steps", "6") == 2
    err = capsys.readouterr().err
    assert "train_state.json" in err and f"field {field!r}" in err and "Traceback" not in err, err[-2000:]
    hostile(f"exit 2: \"...{err[err.find(f'field {field!r}'):][:160]}\"")
