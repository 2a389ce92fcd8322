"""Reading the files of a checkpoint folder as if each could be hostile or half-written.

- Names are confined to the folder: a name from a manifest or from DCP's metadata must be a plain file
  name (no ``/``, no ``..``, not absolute), and it is opened with ``O_NOFOLLOW`` (a symbolic link is
  refused, wherever it points) and ``O_NONBLOCK`` (opening a FIFO cannot block); only a regular file is
  read. A device file (``/dev/zero``), a FIFO or a socket is refused by its type, before any byte is read.
- Every file read whole has a cap (``MAX_JSON`` for the manifest and train_state.json, ``MAX_METADATA``
  for DCP's ``.metadata``), checked on the open file's size and again on what is read, so a file that
  grows while being read cannot make the process read without end.
- ``read_checked`` returns the bytes of a file only after hashing exactly those bytes and comparing them
  with the manifest: what is checked is what is used, even if the file changes between a check and a load.
- A transient I/O error (EIO, ESTALE, a timeout of a network file system) is retried a few times before a
  file is called unreadable (``retry``); a missing file or a refused name is not retried.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _hashers() -> dict[str, Any]:
    out: dict[str, Any] = {"crc32": _Crc32}
    try:
        import xxhash

        out["xxh3_64"] = xxhash.xxh3_64
    except ImportError:
        pass
    return out


HASHERS = _hashers()
ALGORITHM = "xxh3_64" if "xxh3_64" in HASHERS else "crc32"

MAX_JSON = 64 << 20
"""Largest manifest or train_state.json read (a real one is a few kB per thousand files)."""
MAX_METADATA = 1 << 30
"""Largest DCP ``.metadata`` read (about 100 bytes per tensor shard: 1 GiB is ten million shards)."""
MAX_RANK_FILE = 1 << 30
"""Largest per-rank state file read (data-loader position and RNG states: a few kB to a few MB)."""
_CHUNK = 16 << 20
_PERMANENT = {errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EPERM, errno.EISDIR}
RETRIES = (0.2, 1.0, 3.0)
"""Pauses between attempts of a read that failed with a transient I/O error (then it counts as failed)."""
T = TypeVar("T")


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file that is unreadable, malformed, outside its folder, not a regular file, or holds
    something that could execute code."""

    def __init__(self, path: Path | str, reason: str):
        super().__init__(f"{path}: {reason}")
        # an object's address (s3://bucket/key) stays a string: a Path would fold its "//"
        self.path, self.reason = (path if isinstance(path, str) and "://" in path else Path(path)), reason

    def __reduce__(self):  # DCP sends a rank's read error to every rank (pickled)
        return type(self), (self.path, self.reason)


def confined(folder: Path, name: Any) -> Path:
    """``folder/name`` if ``name`` is a plain file name; UnsafeCheckpointFile if it could leave the folder."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UnsafeCheckpointFile(Path(folder) / str(name).replace("\0", "\\0"),
                                   f"the name {name!r} is not a plain file name inside the checkpoint folder "
                                   f"(absolute, with '..' or a separator); refused, nothing outside was read")
    return Path(folder) / name


def open_regular(path: Path):
    """An unbuffered binary file object of ``path`` if it is a regular file (not followed if a link)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeCheckpointFile(path, "is a symbolic link; only regular files inside the checkpoint folder "
                                             "are read (refused, the link was not followed)") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
                    "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
                    "a directory" if stat.S_ISDIR(mode) else "not a regular file")
            raise UnsafeCheckpointFile(path, f"is {kind}, not a regular file; refused without reading it")
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: Path, cap: int) -> bytes:
    """The whole of a regular file of at most ``cap`` bytes."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise UnsafeCheckpointFile(path, f"is {size} bytes, more than the {cap} a file of its kind may have; "
                                             f"refused without reading it")
        data = _read_all(f, cap + 1)
    if len(data) > cap:
        raise UnsafeCheckpointFile(path, f"grew past {cap} bytes while being read; refused")
    return bytes(data)


def _read_all(f, limit: int, hasher=None, alloc: Callable[[int], Any] = bytearray):
    """At most ``limit`` bytes of ``f``, hashed as read: read straight into one buffer of the file's size from
    ``alloc`` (no growing copies; one byte more, so that a file that grew shows as longer), then, only if the
    file grew past that and the buffer is a bytearray, in chunks up to ``limit``."""
    buf = alloc(min(limit, os.fstat(f.fileno()).st_size + 1))
    n = 0
    with memoryview(buf) as view:
        while n < len(buf) and (got := f.readinto(view[n:min(len(buf), n + _CHUNK)])):
            if hasher is not None:
                hasher.update(view[n:n + got])
            n += got
    if not isinstance(buf, bytearray):
        return buf[:n]
    del buf[n:]
    while n < limit and (chunk := f.read(min(_CHUNK, limit - n))):
        buf += chunk
        if hasher is not None:
            hasher.update(chunk)
        n += len(chunk)
    return buf


def read_checked(path: Path, want: dict | None, cap: int, hashers: dict[str, Callable],
                 alloc: Callable[[int], Any] = bytearray) -> Any:
    """The bytes of ``path``, verified against its manifest entry ``want`` (``{"bytes", <algorithm>}``)
    on exactly these bytes; ``want`` None (a checkpoint without checksums): capped only. ``alloc(n)`` makes
    the buffer they are read into (a bytearray, or, for a large file, an uninitialized array: its pages are
    touched once, by the read, not first by zero-filling)."""
    if want is None:
        return read_capped(path, cap)
    size = int(want["bytes"])
    algorithm = next((a for a in hashers if a in want), None)
    hasher = hashers[algorithm]() if algorithm else None
    with open_regular(path) as f:
        data = _read_all(f, min(size, cap) + 1, hasher, alloc)
    return checked(path, data, want, cap, hasher, algorithm)


def checked(path, data, want: dict, cap: int, hasher, algorithm: str | None):
    """``data`` (read from ``path`` and fed to ``hasher`` as it was read) if it is what the manifest entry ``want``
    says; UnsafeCheckpointFile naming the difference otherwise."""
    size = int(want["bytes"])
    if size > cap:
        raise UnsafeCheckpointFile(path, f"the manifest says {size} bytes, more than the {cap} a file of its kind "
                                         f"may have; refused")
    if len(data) != size:
        raise UnsafeCheckpointFile(path, f"{len(data)} bytes read, the manifest says {size} (changed or "
                                         f"truncated since it was checked); refused")
    if hasher is not None and hasher.hexdigest() != want[algorithm]:
        raise UnsafeCheckpointFile(path, f"checksum ({algorithm}) of the bytes read is {hasher.hexdigest()}, the "
                                         f"manifest says {want[algorithm]} (changed since it was checked, or "
                                         f"corrupted); refused, nothing of it was used")
    return data


BLOCK = 4 << 20
"""Bytes per block digest of a large file (the manifest's ``blocks``): what the loader reads and verifies at a
time, so that it needs memory for the largest tensor and two blocks, not for the whole file."""


class VerifiedBlocks:
    """A file read forward in blocks, each hashed and compared with its manifest digest before any byte of
    it is handed out: ``span(a, b)`` is a view of verified bytes ``[a, b)``. One buffer of ``capacity``
    bytes is reused; ``span`` may move what it holds, so a view is valid until the next call. Spans are
    cheapest in increasing order (an earlier one restarts the read at its block)."""

    def __init__(self, path: Path, want: dict, hashers: dict[str, Callable], largest: int,
                 opener: Callable[[], Any] | None = None) -> None:
        self.path, self.size = path if opener else Path(path), int(want["bytes"])
        blocks = want.get("blocks")
        algorithm = next((a for a in hashers if isinstance(blocks, dict) and a in blocks), None)
        self.block = blocks.get("size") if isinstance(blocks, dict) else None
        if (algorithm is None or not isinstance(self.block, int) or isinstance(self.block, bool)
                or not 0 < self.block <= 1 << 30 or not isinstance(blocks[algorithm], list)
                or len(blocks[algorithm]) != -(-self.size // self.block)):
            raise UnsafeCheckpointFile(self.path, f"its manifest entry has no usable block digests ({blocks!r:.80}); "
                                                  f"refused")
        self.digests, self.hasher = blocks[algorithm], hashers[algorithm]
        self.buf = bytearray(min(self.size, largest + 2 * self.block))
        self._address = ctypes.addressof((ctypes.c_char * len(self.buf)).from_buffer(self.buf)) if self.buf else 0
        self.lo = self.n = 0  # the buffer holds verified bytes [lo, lo + n) of the file
        # ``opener``: any seekable reader (an S3 object's); a local file also gets a read-ahead thread
        self.f = opener() if opener else open_regular(self.path)
        try:
            self._ahead = _ReadAhead(self.f.fileno() if not opener else -1, self.size, self.block)
        except BaseException:
            self.f.close()
            raise

    def close(self) -> None:
        self._ahead.stop()
        self.f.close()

    def span(self, a: int, b: int) -> memoryview:
        if not 0 <= a <= b <= self.size:
            raise UnsafeCheckpointFile(self.path, f"bytes {a}-{b} asked for, the manifest says {self.size} bytes")
        start = a // self.block * self.block
        if b > self.lo + self.n or a < self.lo:
            if a < self.lo or start > self.lo + self.n:
                self.lo, self.n = start, 0
            elif start > self.lo:  # keep the verified tail from a's block on (moved to the front, in place)
                keep = self.n - (start - self.lo)
                ctypes.memmove(self._address, self._address + start - self.lo, keep)
                self.lo, self.n = start, keep
            if b - self.lo > len(self.buf):
                raise UnsafeCheckpointFile(self.path, f"bytes {a}-{b} do not fit the {len(self.buf)}-byte buffer "
                                                      f"sized by DCP's metadata")
            while self.lo + self.n < b:
                self._next_block()
        return memoryview(self.buf)[a - self.lo:b - self.lo]

    def _next_block(self) -> None:
        at = self.lo + self.n
        self._ahead.reached(at)
        k, length = at // self.block, min(self.block, self.size - at)
        with memoryview(self.buf) as view:
            dest, got = view[self.n:self.n + length], 0
            self.f.seek(at)
            while got < length and (r := self.f.readinto(dest[got:])):
                got += r
            h = self.hasher()
            h.update(dest[:got])
        if got != length:
            raise UnsafeCheckpointFile(self.path, f"ends at byte {at + got}, the manifest says {self.size} (truncated "
                                                  f"since it was checked); refused")
        if h.hexdigest() != self.digests[k]:
            raise UnsafeCheckpointFile(self.path, f"block {k} (bytes {at}-{at + length}) has checksum "
                                                  f"{h.hexdigest()}, the manifest says {self.digests[k]!r:.40} "
                                                  f"(changed since it was checked, or corrupted); refused, nothing "
                                                  f"of it was used")
        self.n += length


class _ReadAhead:
    """A thread that reads the file ahead of the loader, into a scratch buffer, only to bring its pages into
    the page cache: the loader's own reads (the bytes it verifies and uses) then come from memory while the
    disk works on the next blocks, instead of the disk waiting while the loader hashes and copies. It hands no
    byte to anyone, so nothing it reads can be used unverified; it stays at most ``window`` blocks ahead of
    the loader (bounded page-cache use) and gives up quietly on any error (the loader reports its own)."""

    def __init__(self, fd: int, size: int, block: int, window: int = 8) -> None:
        self.size, self.block, self.limit = size, block, window * block
        self.read_to = 0  # bytes of the file read ahead so far
        self._loader, self._done, self._cv = 0, False, threading.Condition()
        self._fd = -1
        self._thread = threading.Thread(target=self._run, name="checkpoint-read-ahead", daemon=True)
        if hasattr(os, "preadv") and fd >= 0:
            try:
                self._fd = os.dup(fd)
                self._thread.start()
            except (OSError, RuntimeError):  # no descriptor or thread left: the loader reads without help
                if self._fd >= 0:
                    os.close(self._fd)
                self._fd = -1

    def reached(self, at: int) -> None:
        """The loader reads from byte ``at`` on: the thread may go ``window`` blocks beyond it."""
        with self._cv:
            self._loader = at
            self._cv.notify()

    def stop(self) -> None:
        if self._fd < 0:
            return
        with self._cv:
            self._done = True
            self._cv.notify()
        self._thread.join()
        os.close(self._fd)
        self._fd = -1

    def _run(self) -> None:
        scratch = bytearray(self.block)
        try:
            while self.read_to < self.size:
                with self._cv:
                    while not self._done and self.read_to >= self._loader + self.limit:
                        self._cv.wait()
                    if self._done:
                        return
                    self.read_to = max(self.read_to, self._loader)  # bytes the loader skipped are not read
                n = os.preadv(self._fd, [scratch], self.read_to)
                if n <= 0:
                    return  # shorter than the manifest says: the loader finds and reports it
                self.read_to += n
        except OSError:
            return


def retry(fn: Callable[[], T], what: Path, log: Callable[[str], None] | None = None) -> T:
    """``fn()``, again after a pause if it fails with a transient I/O error (len(RETRIES) more times)."""
    for pause in (*RETRIES, None):
        try:
            return fn()
        except OSError as e:
            if e.errno in _PERMANENT or pause is None:
                raise
            if log is not None:
                log(f"{what}: {e.strerror or e} (transient I/O error?); retrying in {pause:.1f} s")
            time.sleep(pause)
    raise AssertionError("unreachable")
