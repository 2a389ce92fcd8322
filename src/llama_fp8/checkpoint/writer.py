"""DCP's file writer, hashing every byte as it writes it.

The manifest needs each file's size and checksum. Reading the files back after the write (from the page
cache) was a second pass over every byte of the checkpoint; hashing the bytes on their way to the file
costs only the hash (XXH3 runs at memory speed). Each ``safe_io.BLOCK`` bytes also get a digest of their own
(the manifest's ``blocks``): the loader verifies a file block by block as it reads it, in one small buffer,
instead of reading the whole file into memory first. DCP writes each file sequentially through ``write``
(``torch.save`` streams its zip archive; ``_write_item`` records offsets with ``tell``), so the digest of
the written bytes is the digest of the file. A file DCP writes some other way (a future torch) has no
digest here and is read back by the checkpointer instead (``manifest.sums``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from llama_fp8.checkpoint import safe_io


class _HashingStream:
    """A binary file opened for writing that hashes what is written to it, in order: the whole, and every
    ``BLOCK`` bytes apart."""

    def __init__(self, f, hasher) -> None:
        self._f, self._new, self.nbytes, self.sequential = f, hasher, 0, True
        self._h, self._block, self.blocks = hasher(), hasher(), []

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self._f.tell() != self.nbytes:  # someone seeked: the digest would not be the file's
            self.sequential = False
        n = self._f.write(view)
        self._h.update(view[:n])
        done = 0
        while done < n:
            room = safe_io.BLOCK - self.nbytes % safe_io.BLOCK
            self._block.update(view[done:done + room])
            step = min(room, n - done)
            done += step
            self.nbytes += step
            if self.nbytes % safe_io.BLOCK == 0:
                self.blocks.append(self._block.hexdigest())
                self._block = self._new()
        return n

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def block_digests(self) -> list[str]:
        return self.blocks + ([self._block.hexdigest()] if self.nbytes % safe_io.BLOCK else [])

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, closed, seek...
        if name == "seek":
            self.sequential = False
        return getattr(self._f, name)


@contextmanager
def _no_zip_crc():
    """``torch.save`` without the CRC-32 of each zip record while a shard file is written: every byte is
    already hashed here on its way to the file, and checked against the manifest at start-up and again as
    the load reads it, so the zip's own pass over the same bytes only costs time (about a tenth of a save).
    torch.load reads such files (``torch.serialization.set_crc32_options``). The option is thread-local, so
    it is set in the thread that writes: an async save's background thread then writes the same bytes as a
    sync save of the same state (a resumed run's files are compared with an uninterrupted run's)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


class _HashingFileSystem(FileSystem):
    def __init__(self, hasher) -> None:
        super().__init__()
        self._hasher, self._lock = hasher, threading.Lock()
        self.digests: dict[str, tuple[int, str, list[str]]] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Path(path).open(mode) as f, _no_zip_crc():
            stream = _HashingStream(f, self._hasher)
            yield stream
            if stream.sequential:
                with self._lock:
                    self.digests[Path(path).name] = (stream.nbytes, stream.hexdigest(), stream.block_digests())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


class HashingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose ``digests`` maps each file name it wrote to (bytes, hex digest, block
    digests)."""

    def __init__(self, path: str, hasher) -> None:
        super().__init__(path)
        self.fs = _HashingFileSystem(hasher)

    @property
    def digests(self) -> dict[str, tuple[int, str, list[str]]]:
        return self.fs.digests
