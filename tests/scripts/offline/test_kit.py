"""The offline kit's builder and installer, on CPU: pruning a fatbin keeps the target architecture's entries
byte for byte (a synthetic ELF library with a .nv_fatbin section, in the layout TE's core library has), the
manifest lists every file with its sha256 and refuses what does not match. The builder: test_build_kit.py."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
from pathlib import Path

import kit
import pytest
from kit_fakes import elf
from kit_fakes import fatbin_container as container
from kit_fakes import fatbin_entry as entry

REPO = Path(__file__).resolve().parents[3]
MAKE_KIT, INSTALL_KIT = REPO / "scripts" / "offline" / "make_kit.sh", REPO / "scripts" / "offline" / "install_kit.sh"


def payload(rng: random.Random, n: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(n))


@pytest.fixture
def library(tmp_path):
    """Two containers (with alignment padding between them), entries for sm_75, sm_90 (twice: sm_90 and
    sm_90a code share the number) and sm_100, plus a .text section that must not change."""
    rng = random.Random(0)
    first = [entry(75, payload(rng, 40)), entry(90, payload(rng, 56)), entry(100, payload(rng, 24)),
             entry(90, payload(rng, 8))]
    second = [entry(100, payload(rng, 16)), entry(90, payload(rng, 32))]
    fatbin = container(first) + bytes(8) + container(second)
    data, where = elf({".text": payload(rng, 100), ".nv_fatbin": fatbin})
    path = tmp_path / "libtransformer_engine.so"
    path.write_bytes(data)
    return path, where, (first, second)


def test_prune_keeps_the_target_entries_byte_for_byte_and_zeroes_the_rest(library):
    path, where, (first, second) = library
    before = path.read_bytes()
    assert kit.main(["prune", str(path), "sm_90"]) == 0
    after = path.read_bytes()
    assert len(after) == len(before)
    off, size = where[".nv_fatbin"]
    assert after[:off] == before[:off] and after[off + size:] == before[off + size:]  # .text, headers unchanged
    c1_len, c2_off = 16 + sum(map(len, first)), off + 16 + sum(map(len, first)) + 8
    kept1 = first[1] + first[3]
    assert struct.unpack_from("<IHHQ", after, off) == (kit.FATBIN_MAGIC, 1, 16, len(kept1))
    assert after[off + 16:off + 16 + len(kept1)] == kept1
    assert after[off + 16 + len(kept1):off + c1_len] == bytes(c1_len - 16 - len(kept1))
    assert struct.unpack_from("<Q", after, c2_off + 8)[0] == len(second[1])
    assert after[c2_off + 16:c2_off + 16 + len(second[1])] == second[1]
    # the pruned file is a valid fatbin again: pruning it once more changes nothing
    assert kit.prune(path, {90}) == {"containers": 2, "kept": len(kept1) + len(second[1]), "zeroed": 0}
    assert path.read_bytes() == after


def test_prune_refuses_a_missing_architecture_and_leaves_the_file_as_it_was(library, capsys):
    path, _, _ = library
    before = path.read_bytes()
    assert kit.main(["prune", str(path), "sm_100"]) == 0  # both containers have sm_100 code
    path.write_bytes(before)
    assert kit.main(["prune", str(path), "sm_80"]) == 2
    assert "has no code for sm_80" in capsys.readouterr().err
    assert path.read_bytes() == before
    assert kit.main(["prune", str(path), "90"]) == 2
    assert "--arch 90: expected sm_NN" in capsys.readouterr().err
    not_elf = path.with_name("x.so")
    not_elf.write_bytes(b"not an ELF file at all" * 4)
    assert kit.main(["prune", str(not_elf), "sm_90"]) == 2
    assert "not a 64-bit little-endian ELF" in capsys.readouterr().err
    no_fatbin = path.with_name("y.so")
    no_fatbin.write_bytes(elf({".text": b"\0" * 16})[0])
    assert kit.main(["prune", str(no_fatbin), "sm_90"]) == 2
    assert "no .nv_fatbin section" in capsys.readouterr().err


def make_files(folder: Path) -> dict[str, bytes]:
    files = {"torchao-0.18.0-py3-none-any.whl": b"ao", "transformer_engine_torch-2.20.2.tar.gz": b"src",
             "built/te2.20.2-torch2.11.0_cu130-cp312/transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl":
                 b"ext"}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def test_manifest_lists_every_file_with_its_sha256_and_verify_refuses_changes(tmp_path, capsys):
    files = make_files(tmp_path)
    (tmp_path / "notes.txt").write_text("not a kit file")
    assert kit.main(["manifest", str(tmp_path), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90,sm_100",
                     "--te", "2.20.2"]) == 0
    manifest = json.loads((tmp_path / kit.MANIFEST).read_text())
    assert manifest["target"] == {"python": "3.12", "torch": "2.11.0", "arch": "sm_90,sm_100", "te": "2.20.2",
                                  "torchao": None}
    assert manifest["files"] == {n: {"sha256": hashlib.sha256(d).hexdigest(), "bytes": len(d)} for n, d in files.items()}
    assert kit.main(["verify", str(tmp_path)]) == 0
    (tmp_path / "torchao-0.18.0-py3-none-any.whl").write_bytes(b"changed")
    (tmp_path / "extra-1.0-py3-none-any.whl").write_bytes(b"x")
    (tmp_path / "transformer_engine_torch-2.20.2.tar.gz").unlink()
    assert kit.main(["verify", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert ("missing: transformer_engine_torch-2.20.2.tar.gz; sha256 differs: torchao-0.18.0-py3-none-any.whl; "
            "not in the manifest: extra-1.0-py3-none-any.whl") in err
    hostile = {"files": {"../outside.whl": {"sha256": "0"}}}
    (tmp_path / kit.MANIFEST).write_text(json.dumps(hostile))
    assert kit.main(["verify", str(tmp_path)]) == 2 and "outside the kit's folder: '../outside.whl'" in capsys.readouterr().err
    (tmp_path / kit.MANIFEST).write_text("{not json")
    assert kit.main(["verify", str(tmp_path)]) == 2 and "not a kit manifest" in capsys.readouterr().err
    assert kit.main(["manifest", str(tmp_path), "--python", "3.12", "--torch", "2.11.0", "--arch", "h100"]) == 2


def sh(script: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_make_kit_never_writes_into_a_folder_it_did_not_make(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    out = sh(MAKE_KIT, str(tmp_path), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90")
    assert out.returncode == 2 and "holds no MANIFEST.json: not a kit made here" in out.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


def test_install_refuses_a_kit_that_does_not_match_its_manifest(tmp_path):
    make_files(tmp_path / "kit")
    assert kit.main(["manifest", str(tmp_path / "kit"), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90"]) == 0
    (tmp_path / "kit" / "torchao-0.18.0-py3-none-any.whl").write_bytes(b"tampered")
    out = sh(INSTALL_KIT, str(tmp_path / "kit"), str(tmp_path / "site"))
    assert out.returncode == 2 and "sha256 differs: torchao-0.18.0-py3-none-any.whl" in out.stderr
    assert not (tmp_path / "site").exists()
    assert sh(INSTALL_KIT).returncode == 2
