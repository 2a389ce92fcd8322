"""A checkpoint's shard files are verified block by block as the load reads them: each block's digest is
written with the file, the reader hands out only bytes of blocks that matched, in one small reused buffer,
and every tensor is loaded as a view of those bytes (no copy per tensor)."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch
from ckpt_kit import run
from test_save_resume import losses_by_step

from llama_fp8.checkpoint import dcp_read as D
from llama_fp8.checkpoint import safe_io as S
from llama_fp8.checkpoint import writer as W


def digest(data: bytes) -> str:
    h = S.HASHERS[S.ALGORITHM]()
    h.update(data)
    return h.hexdigest()


def write_hashed(path, data: bytes, chunks: list[int]) -> tuple[int, str, list[str]]:
    """Write ``data`` through the save's hashing stream in writes of the given sizes (cycled)."""
    with open(path, "wb") as f:
        stream, at, i = W._HashingStream(f, S.HASHERS[S.ALGORITHM]), 0, 0
        while at < len(data):
            n = chunks[i % len(chunks)]
            stream.write(data[at:at + n])
            at, i = at + n, i + 1
    return stream.nbytes, stream.hexdigest(), stream.block_digests()


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(S, "BLOCK", 4096)
    return 4096


@pytest.fixture
def blocked_file(tmp_path, small_blocks):
    data = random.Random(0).randbytes(10 * small_blocks + 1234)
    path = tmp_path / "__0_0.distcp"
    nbytes, whole, blocks = write_hashed(path, data, [1, 4095, 5000, 7, 12288])  # writes across block edges
    want = {"bytes": nbytes, S.ALGORITHM: whole, "blocks": {"size": small_blocks, S.ALGORITHM: blocks}}
    return path, data, want


def test_the_hashing_writer_digests_every_block_of_what_it_wrote(blocked_file, small_blocks):
    path, data, want = blocked_file
    blocks = want["blocks"][S.ALGORITHM]
    assert path.read_bytes() == data and want[S.ALGORITHM] == digest(data)
    assert len(blocks) == 11  # ten full blocks and a part
    assert blocks == [digest(data[i:i + small_blocks]) for i in range(0, len(data), small_blocks)]


def test_spans_in_any_order_are_the_file_bytes_and_the_buffer_stays_small(blocked_file, small_blocks):
    path, data, want = blocked_file
    reader = S.VerifiedBlocks(path, want, S.HASHERS, largest=6000)
    try:
        spans = [(0, 10), (10, 4096), (4090, 4200), (4200, 10000), (10000, 10000), (20000, 26000),
                 (len(data) - 1, len(data)), (5, 6), (8191, 8193), (30000, 36000)]
        for a, b in spans:
            assert bytes(reader.span(a, b)) == data[a:b], (a, b)
        assert len(reader.buf) == 6000 + 2 * small_blocks  # the largest span and two blocks, not the file
    finally:
        reader.close()


def test_a_block_changed_after_the_check_is_refused_when_it_is_reached(blocked_file, small_blocks):
    path, data, want = blocked_file
    changed = bytearray(data)
    changed[3 * small_blocks + 17] ^= 0x01
    path.write_bytes(bytes(changed))
    reader = S.VerifiedBlocks(path, want, S.HASHERS, largest=small_blocks)
    try:
        assert bytes(reader.span(0, 3 * small_blocks)) == data[:3 * small_blocks]  # blocks 0-2 are intact
        with pytest.raises(S.UnsafeCheckpointFile, match="block 3 .*changed since it was checked"):
            reader.span(3 * small_blocks, 3 * small_blocks + 20)
    finally:
        reader.close()
    path.write_bytes(data[:5 * small_blocks + 10])  # truncated
    reader = S.VerifiedBlocks(path, want, S.HASHERS, largest=small_blocks)
    try:
        with pytest.raises(S.UnsafeCheckpointFile, match="truncated"):
            reader.span(5 * small_blocks, 5 * small_blocks + 100)
        with pytest.raises(S.UnsafeCheckpointFile, match="asked for"):
            reader.span(0, len(data) + 1)  # past the end the manifest gives
    finally:
        reader.close()


@pytest.mark.parametrize("forge", [
    pytest.param(lambda b: b[S.ALGORITHM].pop(), id="one digest missing"),
    pytest.param(lambda b: b.update(size=0), id="block size 0"),
    pytest.param(lambda b: b.update(size=True), id="block size a bool"),
    pytest.param(lambda b: b.update(size=1 << 40), id="block size 1 TiB"),
    pytest.param(lambda b: b.update({S.ALGORITHM: "abc"}), id="digests not a list"),
    pytest.param(lambda b: b.pop(S.ALGORITHM), id="no digests of a known algorithm")])
def test_forged_block_entries_are_refused_before_anything_is_read(blocked_file, forge):
    path, _, want = blocked_file
    forge(want["blocks"])
    with pytest.raises(S.UnsafeCheckpointFile, match="no usable block digests"):
        S.VerifiedBlocks(path, want, S.HASHERS, largest=100)


def test_a_tensor_is_loaded_as_a_view_of_its_verified_bytes(monkeypatch):
    t = torch.randn(300, 7)
    buf = io.BytesIO()
    torch.save(t, buf)
    record = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    got = D.load_tensor(record)
    assert torch.equal(got, t)
    lo, hi = record.data_ptr(), record.data_ptr() + record.numel()
    assert D._ZERO_COPY and lo <= got.data_ptr() < hi  # shares the record's memory: no copy
    monkeypatch.setattr(D, "_ZERO_COPY", False)  # a torch without the entry point: torch.load, a copy
    copied = D.load_tensor(record)
    assert torch.equal(copied, t) and not lo <= copied.data_ptr() < hi
    torch.save({"not": "a tensor"}, buf := io.BytesIO())
    with pytest.raises(Exception, match="a tensor entry holds a dict"):
        D.load_tensor(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))


@pytest.mark.slow
def test_saved_shards_carry_block_digests_and_resume_the_same_with_or_without_them(saved, tmp_path, monkeypatch):
    folder = saved / "checkpoints" / "step_4"
    man = json.loads((folder / "COMPLETE").read_text())
    shard = man["files"]["__0_0.distcp"]
    data = (folder / "__0_0.distcp").read_bytes()
    assert shard["bytes"] == len(data) > S.BLOCK  # the tiny model's shard file spans several blocks
    assert shard["blocks"] == {"size": S.BLOCK, S.ALGORITHM: [digest(data[i:i + S.BLOCK])
                                                              for i in range(0, len(data), S.BLOCK)]}
    readers: list = []
    real = S.VerifiedBlocks
    monkeypatch.setattr(S, "VerifiedBlocks", lambda *a, **kw: readers.append(1) or real(*a, **kw))

    import shutil
    other = tmp_path / "no_blocks"
    shutil.copytree(saved, other, symlinks=True)
    for entry in man["files"].values():  # as an earlier version wrote it: whole-file digests only
        entry.pop("blocks", None)
    (other / "checkpoints" / "step_4" / "COMPLETE").write_text(json.dumps(man))

    assert run(saved, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    assert readers, "the load did not read the shard block by block"
    del readers[:]
    assert run(other, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    assert not readers  # no block digests: the file is read whole, then verified
    a, b = losses_by_step(saved), losses_by_step(other)
    assert [a[s] for s in (5, 6)] == [b[s] for s in (5, 6)]


def test_dcp_metadata_is_read_once_per_load_and_that_read_is_what_the_load_uses(saved, monkeypatch):
    """The shape check and DCP's planner use one read of .metadata (the allow-list unpickler is the slow
    part of a small checkpoint's load), so the two cannot disagree either."""
    from llama_fp8.checkpoint import checkpointer

    reads, seen, during = [], [], []
    real_read, real_plan, real_load = D.read_dcp_metadata, D.SafeLoadPlanner.set_up_planner, \
        checkpointer.Checkpointer.load
    monkeypatch.setattr(D, "read_dcp_metadata", lambda *a, **kw: reads.append(real_read(*a, **kw)) or reads[-1])

    def plan(self, state_dict, metadata=None, *a, **kw):
        seen.append(metadata)
        return real_plan(self, state_dict, metadata, *a, **kw)

    def load(self, *a, **kw):
        before = len(reads)
        try:
            return real_load(self, *a, **kw)
        finally:
            during.extend(reads[before:])

    monkeypatch.setattr(D.SafeLoadPlanner, "set_up_planner", plan)
    monkeypatch.setattr(checkpointer.Checkpointer, "load", load)
    assert run(saved, "--max_steps", "5", "--checkpoint_freq", "0") == 0
    assert len(during) == 1 and len(seen) == 1 and seen[0] is during[0], (len(during), len(seen))



def zip_record_crcs(data: bytes) -> list[int]:
    """The CRC-32 field of every zip central directory entry in ``data`` (a DCP shard is torch.save archives
    back to back; torch writes the local headers' CRC as 0 and the real one after the data and here)."""
    import struct

    crcs, at = [], data.find(b"PK\x01\x02")
    while at >= 0:
        crcs.append(struct.unpack_from("<I", data, at + 16)[0])
        at = data.find(b"PK\x01\x02", at + 4)
    return crcs


def test_sync_and_async_saves_write_the_same_bytes_without_zip_crcs(tmp_path):
    """Every byte is hashed for the manifest as it is written, so the zip's own CRC pass is skipped; a sync
    and an async save of the same state must still be byte-identical (the fault matrix compares them)."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, 200, generator=g), "b": torch.randn(77, generator=g), "step": 3}
    dcp.save(state, storage_writer=W.HashingFileSystemWriter(str(tmp_path / "sync"), S.HASHERS[S.ALGORITHM]),
             no_dist=True)
    dcp.async_save(state, storage_writer=W.HashingFileSystemWriter(str(tmp_path / "async"), S.HASHERS[S.ALGORITHM]),
                   no_dist=True).result()
    assert torch.serialization.get_crc32_options()  # switched off only while a shard is written
    shards = sorted(p.name for p in (tmp_path / "sync").glob("*.distcp"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "async").glob("*.distcp"))
    for name in shards:
        data = (tmp_path / "sync" / name).read_bytes()
        assert data == (tmp_path / "async" / name).read_bytes()
        crcs = zip_record_crcs(data)
        assert len(crcs) >= 3 and set(crcs) == {0}, crcs
    back = {"w": torch.zeros(300, 200), "b": torch.zeros(77), "step": 0}
    dcp.load(back, storage_reader=D.SafeFileSystemReader(str(tmp_path / "async")), planner=D.SafeLoadPlanner(),
             no_dist=True)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"]) and back["step"] == 3


def wait_until(cond, timeout: float = 10.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_the_read_ahead_stays_a_window_ahead_of_the_loader_and_leaves_nothing_open(tmp_path, monkeypatch):
    import os
    import time

    block, data = 4096, random.Random(1).randbytes(40 * 4096 + 100)
    (path := tmp_path / "f").write_bytes(data)
    fds, offsets, preadv = len(os.listdir("/proc/self/fd")), [], os.preadv
    monkeypatch.setattr(S.os, "preadv", lambda fd, bufs, at: offsets.append(at) or preadv(fd, bufs, at))
    with open(path, "rb") as f:
        ahead = S._ReadAhead(f.fileno(), len(data), block, window=3)
        wait_until(lambda: ahead.read_to >= 3 * block)
        time.sleep(0.05)
        assert ahead.read_to == 3 * block  # no further than the window while the loader stays at 0
        ahead.reached(10 * block)
        wait_until(lambda: ahead.read_to >= 13 * block)
        time.sleep(0.05)
        assert ahead.read_to == 13 * block
        assert offsets == [i * block for i in (0, 1, 2, 10, 11, 12)]  # what the loader skipped is not read
        ahead.reached(len(data))
        wait_until(lambda: ahead.read_to == len(data))
        ahead.stop()
        assert not ahead._thread.is_alive()
    assert len(os.listdir("/proc/self/fd")) == fds  # its own descriptor is closed too


def test_the_read_ahead_stops_at_a_short_file_and_with_the_loader(blocked_file, small_blocks):
    path, data, want = blocked_file
    path.write_bytes(data[:3 * small_blocks])  # truncated after the check: the loader refuses it, not the thread
    reader = S.VerifiedBlocks(path, want, S.HASHERS, largest=100)
    assert bytes(reader.span(0, 100)) == data[:100]
    wait_until(lambda: not reader._ahead._thread.is_alive())  # read to the end of what is there, then stopped
    assert reader._ahead.read_to == 3 * small_blocks
    with pytest.raises(S.UnsafeCheckpointFile, match="truncated since it was checked"):
        reader.span(3 * small_blocks, 3 * small_blocks + 100)
    reader.close()
    path.write_bytes(data)
    reader = S.VerifiedBlocks(path, want, S.HASHERS, largest=100)  # the loader closes before the end
    reader.close()
    assert not reader._ahead._thread.is_alive()


def test_without_a_read_ahead_thread_the_load_reads_alone_and_leaks_nothing(blocked_file, small_blocks,
                                                                            monkeypatch):
    import os

    path, data, want = blocked_file

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(S.threading.Thread, "start", no_thread)
    fds = len(os.listdir("/proc/self/fd"))
    reader = S.VerifiedBlocks(path, want, S.HASHERS, largest=len(data))
    assert bytes(reader.span(0, len(data))) == data
    reader.close()
    assert len(os.listdir("/proc/self/fd")) == fds  # neither the file nor a duplicate descriptor left open
