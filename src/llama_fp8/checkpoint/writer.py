"""DCP's file writer, hashing every byte as it writes it.

The manifest needs each file's size and checksum. Reading the files back after the write (from the page
cache) was a second pass over every byte of the checkpoint; hashing the bytes on their way to the file
costs only the hash (XXH3 runs at memory speed). DCP writes each file sequentially through ``write``
(``torch.save`` streams its zip archive; ``_write_item`` records offsets with ``tell``), so the digest of
the written bytes is the digest of the file. A file DCP writes some other way (a future torch) has no
digest here and is read back by the checkpointer instead (``manifest.sums``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem


class _HashingStream:
    """A binary file opened for writing that hashes what is written to it, in order."""

    def __init__(self, f, hasher) -> None:
        self._f, self._h, self.nbytes, self.sequential = f, hasher, 0, True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self._f.tell() != self.nbytes:  # someone seeked: the digest would not be the file's
            self.sequential = False
        n = self._f.write(view)
        self._h.update(view[:n])
        self.nbytes += n
        return n

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, closed, seek...
        if name == "seek":
            self.sequential = False
        return getattr(self._f, name)


class _HashingFileSystem(FileSystem):
    def __init__(self, hasher) -> None:
        super().__init__()
        self._hasher, self._lock = hasher, threading.Lock()
        self.digests: dict[str, tuple[int, str]] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode or "+" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with Path(path).open(mode) as f:
            stream = _HashingStream(f, self._hasher())
            yield stream
            if stream.sequential:
                with self._lock:
                    self.digests[Path(path).name] = (stream.nbytes, stream.hexdigest())

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.digests:
                self.digests[Path(new_path).name] = self.digests.pop(Path(path).name)


class HashingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose ``digests`` maps each file name it wrote to (bytes, hex digest)."""

    def __init__(self, path: str, hasher) -> None:
        super().__init__(path)
        self.fs = _HashingFileSystem(hasher)

    @property
    def digests(self) -> dict[str, tuple[int, str]]:
        return self.fs.digests
