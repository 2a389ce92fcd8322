"""The in-memory file DCP reads a verified checkpoint file through: same answers as io.BytesIO, no copy."""

from __future__ import annotations

import io

import torch

from llama_fp8.checkpoint import safe_io as S
from llama_fp8.checkpoint.dcp_read import MemoryFile


def test_memory_file_reads_and_seeks_like_bytesio():
    data = bytes(range(256)) * 40
    ours, ref = MemoryFile(bytearray(data)), io.BytesIO(data)
    for op, arg in [("read", 10), ("seek", 100), ("read", 0), ("read", 37), ("seek_cur", 5), ("read", 3),
                    ("seek_end", -7), ("read", 100), ("read", 5), ("seek", 0), ("read", -1)]:
        if op == "read":
            assert ours.read(arg) == ref.read(arg), (op, arg)
        elif op == "seek":
            assert ours.seek(arg) == ref.seek(arg)
        elif op == "seek_cur":
            assert ours.seek(arg, io.SEEK_CUR) == ref.seek(arg, io.SEEK_CUR)
        else:
            assert ours.seek(arg, io.SEEK_END) == ref.seek(arg, io.SEEK_END)
        assert ours.tell() == ref.tell()
    ours.seek(50)
    into = bytearray(20)
    assert ours.readinto(into) == 20 and bytes(into) == data[50:70]


def test_torch_load_through_memory_file_gives_the_saved_values():
    t = torch.randn(1000, 7)
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    assert torch.equal(torch.load(MemoryFile(bytearray(buf.getvalue())), weights_only=True)["w"], t)


def test_read_checked_returns_exactly_the_file_and_refuses_a_longer_one(tmp_path):
    """The preallocated read returns the whole file; a file longer than its manifest entry is refused."""
    path = tmp_path / "shard"
    path.write_bytes(b"x" * 100_000)
    h = S.HASHERS[S.ALGORITHM]()
    h.update(b"x" * 100_000)
    want = {"bytes": 100_000, S.ALGORITHM: h.hexdigest()}
    assert bytes(S.read_checked(path, want, 1 << 30, S.HASHERS)) == b"x" * 100_000
    path.write_bytes(b"x" * 100_001)
    try:
        S.read_checked(path, want, 1 << 30, S.HASHERS)
    except S.UnsafeCheckpointFile as e:
        assert "100001 bytes read" in str(e)
    else:
        raise AssertionError("a file longer than its manifest entry was accepted")
    assert S.read_capped(path, 1 << 20) == b"x" * 100_001
