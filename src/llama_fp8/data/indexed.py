"""One shard of a tokenized corpus: a ``.bin`` of tokens and its ``.idx``, in the memory-mappable indexed format
Megatron-LM reads and writes (``megatron.core.datasets.indexed_dataset``), so corpora tokenized for Megatron
load here as they are, and ours load in Megatron.

The format (little-endian), as Megatron's ``_IndexWriter`` writes it:

- ``.idx``: the 9 bytes ``MMIDIDX\\0\\0``, u64 version (1), u8 token dtype code (1 uint8, 2 int8, 3 int16, 4 int32,
  5 int64, 8 uint16; 6 and 7 are floats, refused here), u64 sequence count S, u64 document-index count D, then
  int32[S] sequence lengths (tokens), int64[S] sequence pointers (byte offsets into the ``.bin``), int64[D] document
  indices (sequence index where each document starts; the first 0, the last S), and for multimodal corpora int8[S]
  modes (ignored here).
- ``.bin``: the sequences' tokens back to back, in index order.

A document is the sequences between two document indices; ours hold one sequence each (``[BOS] tokens [EOS]``).

Reads are positioned reads (``os.pread``) of exactly the bytes a sample needs, not a memory mapping: samples are read
in a shuffled order, and a mapping of a file read at random grows the reader's resident memory with every page the
kernel maps around each one touched (64 KiB at a time: fault-around), up to the size of the corpus. Read this way the
reader holds nothing of the corpus but what it copied (benchmarks/README.md: the same memory for a corpus ten times
larger). Open files are shared by every shard of the process, at most ``MAX_OPEN`` at once (a corpus may have more
shards than a process may open files).

Every file may be hostile or half-written. Opening checks what costs O(1): the header, the ``.idx`` size against its
counts, the first and last pointers and document indices, and the ``.bin`` size against the last pointer (a truncated
``.bin`` or an index pointing past its end is refused naming the file). Reads take tokens by offset from the ``.bin``
(always inside the file: its token count comes from its size), and the document boundaries of a read are checked
locally against the index (an entry in the middle that points elsewhere is refused when a read meets it); ``llama_fp8
tokenize --verify`` checks every byte against the manifest's checksums.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import os
import struct
import threading
from pathlib import Path

import numpy as np

from llama_fp8.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}  # token dtypes (no floats)
CODE_OF = {np.dtype(t).name: c for c, t in CODES.items()}
MAX_SEQUENCE_TOKENS = 2**31 - 1  # lengths are int32 in the index
_BLOCK = 1 << 22  # entries per chunk when hashing or checking a whole index: memory stays flat


class CorpusError(ConfigError):
    """A corpus file that is not what it claims to be (named in the message); a start-up error (exit 2)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest dtype for token ids below ``vocab_size`` (Megatron's rule: uint16 below 65,500, else int32)."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedShard:
    """A ``.bin``/``.idx`` pair opened read-only (checked, read as needed); ``prefix`` is the path without the suffix."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = Path(prefix)
        self.idx_path, self.bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        self.dtype, self.n_sequences, n_doc_index = self._read_header()
        self.itemsize = self.dtype.itemsize
        s = self.n_sequences
        self.lengths = Column(self.idx_path, np.int32, HEADER_BYTES, s)
        self.pointers = Column(self.idx_path, np.int64, HEADER_BYTES + 4 * s, s)
        self.doc_index = Column(self.idx_path, np.int64, HEADER_BYTES + 12 * s, n_doc_index)
        self.bin_bytes = _size(self.bin_path)
        self._check_ends()
        self.n_tokens = self.bin_bytes // self.itemsize
        self.n_docs = n_doc_index - 1

    def read_tokens(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of the shard (a copy, in the file's dtype)."""
        assert 0 <= a <= b <= self.n_tokens, (a, b, self.n_tokens)
        return np.frombuffer(FILES.pread(self.bin_path, (b - a) * self.itemsize, a * self.itemsize), self.dtype)

    def _fail(self, path: Path, why: str) -> CorpusError:
        return CorpusError(f"{path}: {why}; refused (re-create it with llama_fp8 tokenize, or remove it)")

    def _read_header(self) -> tuple[np.dtype, int, int]:
        size = _size(self.idx_path)
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:9] != MAGIC:
            raise self._fail(self.idx_path, f"not an indexed-dataset index (no {MAGIC!r} header)")
        version, code, s, d = struct.unpack("<QBQQ", head[9:])
        if version != VERSION:
            raise self._fail(self.idx_path, f"index version {version}, only version {VERSION} exists")
        if code not in CODES:
            raise self._fail(self.idx_path, f"token dtype code {code} (valid: {sorted(CODES)}: integer tokens)")
        want = HEADER_BYTES + 12 * s + 8 * d
        if size not in (want, want + s):  # + int8 modes of a multimodal corpus
            raise self._fail(self.idx_path, f"{size} bytes, but its header counts {s} sequences and {d} document "
                                            f"indices ({want} bytes): truncated or forged")
        if d < 1:
            raise self._fail(self.idx_path, "no document index (it must start with 0)")
        return np.dtype(CODES[code]), int(s), int(d)

    def _check_ends(self) -> None:
        """The O(1) checks: first and last entries, and the ``.bin`` size they imply."""
        s = self.n_sequences
        first, last = self.doc_index[0], self.doc_index[len(self.doc_index) - 1]
        if first != 0 or last != s:
            raise self._fail(self.idx_path, f"document indices run from {first} to {last}, not from 0 to the "
                                            f"sequence count {s}")
        end = 0
        if s:
            if self.pointers[0] != 0:
                raise self._fail(self.idx_path, f"the first sequence starts at byte {self.pointers[0]}, not 0")
            last_ptr, last_len = self.pointers[s - 1], self.lengths[s - 1]
            if last_len < 0 or last_ptr < 0:
                raise self._fail(self.idx_path, "the last sequence has a negative length or pointer")
            end = last_ptr + last_len * self.itemsize
        if s and self.pointers[s - 1] > self.bin_bytes:
            raise self._fail(self.idx_path, f"its last sequence starts at byte {self.pointers[s - 1]}, past the end "
                                            f"of {self.bin_path.name} ({self.bin_bytes} bytes)")
        if end > self.bin_bytes:
            raise self._fail(self.bin_path, f"truncated: {self.bin_bytes} bytes, but its index {self.idx_path.name} "
                                            f"needs {end}")
        if end != self.bin_bytes:
            raise self._fail(self.bin_path, f"{self.bin_bytes} bytes, but its index {self.idx_path.name} accounts "
                                            f"for {end}: not the file the index was written for")

    # --- reads -----------------------------------------------------------------------------------------
    def doc_starts(self, a: int, b: int) -> np.ndarray:
        """Token offsets in [a, b) at which a document starts (sorted, unique), checked against the index around
        them: a read never trusts an entry it did not check."""
        size = self.itemsize
        i0, i1 = self.pointers.searchsorted(a * size), self.pointers.searchsorted(b * size)
        lo, hi = max(i0 - 1, 0), min(i1 + 1, self.n_sequences)
        ptr, length = self.pointers.slice(lo, hi), self.lengths.slice(lo, hi).astype(np.int64)
        wrong = np.r_[ptr[:1] < 0, ptr[1:] != ptr[:-1] + length[:-1] * size] | (length < 0) | \
            (ptr + length * size > self.bin_bytes)
        if wrong.any():
            bad = int(np.argmax(wrong))
            raise self._fail(self.idx_path, f"sequence {lo + bad} of {self.n_sequences} points at byte {int(ptr[bad])} "
                                            f"with {int(length[bad])} tokens, which is not where the sequence before "
                                            f"it ends, or past the end of {self.bin_path.name} ({self.bin_bytes} bytes)")
        d0, d1 = self.doc_index.searchsorted(i0), self.doc_index.searchsorted(i1)
        docs = self.doc_index.slice(d0, d1)
        if len(docs) and (docs[0] < i0 or docs[-1] >= i1 or np.any(np.diff(docs) < 0)):
            raise self._fail(self.idx_path, f"document indices {d0}..{d1} are not increasing sequence indices")
        return np.unique(ptr[docs - lo] // size)

    def verify(self, bin_sha256: str | None, idx_sha256: str | None) -> None:
        """Every byte: the two files' SHA-256 against the manifest's, and every index entry consistent."""
        for path, want in ((self.bin_path, bin_sha256), (self.idx_path, idx_sha256)):
            if want is not None and sha256_file(path) != want:
                raise self._fail(path, "its SHA-256 differs from the manifest's: changed since it was tokenized")
        size, end = self.itemsize, 0
        for i in range(0, self.n_sequences, _BLOCK):
            ptr = self.pointers.slice(i, min(i + _BLOCK, self.n_sequences))
            length = self.lengths.slice(i, min(i + _BLOCK, self.n_sequences)).astype(np.int64)
            want = end + np.concatenate([[0], np.cumsum(length[:-1] * size)])
            if np.any(length < 0) or np.any(ptr != want):
                bad = i + int(np.argmax((ptr != want) | (length < 0)))
                raise self._fail(self.idx_path, f"sequence {bad} points at byte {self.pointers[bad]}, "
                                                f"not where the one before it ends")
            end = int(want[-1] + length[-1] * size) if len(ptr) else end
        for i in range(0, self.n_docs + 1, _BLOCK):
            docs = self.doc_index.slice(max(i - 1, 0), min(i + _BLOCK, self.n_docs + 1))
            if np.any(np.diff(docs) < 0):
                raise self._fail(self.idx_path, "document indices are not increasing")


class IndexedWriter:
    """Writes one shard: documents appended as token arrays; ``finish`` writes the index and renames both files into
    place (the ``.idx`` last: a shard without its ``.idx`` is not a shard). Megatron's ``IndexedDataset`` reads it."""

    def __init__(self, prefix: Path, dtype: np.dtype) -> None:
        self.prefix, self.dtype = Path(prefix), np.dtype(dtype)
        self._tmp_bin = Path(f"{prefix}.bin.tmp.{os.getpid()}")  # a second writer of the shard never shares it
        self._bin = open(self._tmp_bin, "wb")
        self._hash = hashlib.sha256()
        self._lengths: list[np.ndarray] = []

    def add(self, stream: np.ndarray, lengths: np.ndarray) -> None:
        """Documents back to back in ``stream`` (their tokens), ``lengths`` tokens each."""
        if len(lengths) and int(lengths.max()) > MAX_SEQUENCE_TOKENS:
            raise ValueError(f"a document of {int(lengths.max())} tokens: the index holds at most "
                             f"{MAX_SEQUENCE_TOKENS} per document")
        data = np.ascontiguousarray(stream, dtype=self.dtype).tobytes()
        self._bin.write(data)
        self._hash.update(data)
        self._lengths.append(np.asarray(lengths, np.int32))

    def finish(self) -> dict:
        """Close, write the index, rename into place; returns the shard's counts, sizes and SHA-256s."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.empty(0, np.int32)
        n = len(lengths)
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * self.dtype.itemsize if n else \
            np.empty(0, np.int64)
        body = b"".join([MAGIC, struct.pack("<QBQQ", VERSION, CODE_OF[self.dtype.name], n, n + 1),
                         lengths.tobytes(), pointers.astype(np.int64).tobytes(),
                         np.arange(n + 1, dtype=np.int64).tobytes()])
        tmp_idx = Path(f"{self.prefix}.idx.tmp.{os.getpid()}")
        with open(tmp_idx, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, f"{self.prefix}.bin")
        os.replace(tmp_idx, f"{self.prefix}.idx")
        return {"documents": n, "tokens": int(lengths.sum(dtype=np.int64)),
                "bin_bytes": int(lengths.sum(dtype=np.int64)) * self.dtype.itemsize, "idx_bytes": len(body),
                "bin_sha256": self._hash.hexdigest(), "idx_sha256": hashlib.sha256(body).hexdigest()}


class Column:
    """An array stored in a file (a column of an index), read by positioned reads when needed."""

    def __init__(self, path: Path, dtype, offset: int, count: int) -> None:
        self.path, self.dtype, self.offset, self.count = path, np.dtype(dtype), offset, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> int:
        assert 0 <= i < self.count, (i, self.count)
        return int(self.slice(i, i + 1)[0])

    def slice(self, lo: int, hi: int) -> np.ndarray:
        n = max(hi - lo, 0)
        size = self.dtype.itemsize
        return np.frombuffer(FILES.pread(self.path, n * size, self.offset + lo * size), self.dtype)

    def searchsorted(self, value: int) -> int:
        """The first index whose entry is >= ``value`` (the column sorted), by binary search: log2(n) small reads."""
        return bisect.bisect_left(self, value)


class OpenFiles:
    """The file descriptors reads go through: opened when first read, at most ``limit`` at once (the least recently
    used one that no thread is reading is closed), shared by every shard and thread of the process."""

    def __init__(self, limit: int) -> None:
        self.limit, self._fds, self._busy = limit, collections.OrderedDict(), collections.Counter()
        self._lock = threading.Lock()

    def pread(self, path: Path, n: int, offset: int) -> bytes:
        """Exactly ``n`` bytes at ``offset``; CorpusError naming the file if it has fewer (changed while in use)."""
        key = str(path)
        with self._lock:
            fd = self._fds.pop(key, None)
            if fd is None:
                try:
                    fd = os.open(key, os.O_RDONLY)
                except OSError as e:
                    raise CorpusError(f"{path}: cannot be read ({e.strerror})") from None
            self._fds[key] = fd  # the most recently used last
            self._busy[key] += 1
        try:
            data = os.pread(fd, n, offset) if n else b""
        finally:
            with self._lock:
                self._busy[key] -= 1
                for idle in [k for k in self._fds if not self._busy[k]][:max(len(self._fds) - self.limit, 0)]:
                    os.close(self._fds.pop(idle))
        if len(data) != n:
            raise CorpusError(f"{path}: {n} bytes at {offset} asked, {len(data)} there: the file changed while it "
                              f"was read; refused")
        return data


MAX_OPEN = 256
FILES = OpenFiles(MAX_OPEN)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror})") from None
