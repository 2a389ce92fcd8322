"""A tokenized corpus on disk, opened as one token stream per split: ours (a folder with ``manifest.json``, written by
``llama_fp8 tokenize``) or Megatron's (a ``.bin``/``.idx`` prefix, or a folder of such pairs).

A split's shards, in order, are one stream of tokens; documents are already separated in it (ours: ``[BOS] tokens
[EOS]`` each; Megatron's: as its preprocessing wrote them, usually with an end-of-document token). Reads take any
token range of the stream, across shards, straight from the files (``indexed.py``: positioned reads), plus the offsets
at which documents start in it (for ``--doc_masking``). Nothing is loaded whole: a corpus ten times larger costs a
reader no more memory.

What is checked when a corpus is opened is in ``indexed.py`` (each shard) and ``manifest.py`` (the manifest); here,
the manifest against the shards (counts, sizes, dtype) and against ``--tokenizer`` (its SHA-256).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from llama_fp8.data import manifest as mf
from llama_fp8.data.indexed import CorpusError, IndexedShard

MAX_MEGATRON_SHARDS = 100_000


@dataclass
class CorpusSplit:
    """One split's shards as one stream of ``n_tokens`` tokens."""

    shards: list[IndexedShard]
    offsets: np.ndarray = field(init=False)  # (n_shards + 1,) token offset of each shard in the stream

    def __post_init__(self) -> None:
        self.offsets = np.concatenate([[0], np.cumsum([s.n_tokens for s in self.shards], dtype=np.int64)])

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def n_docs(self) -> int:
        return sum(s.n_docs for s in self.shards)

    def _pieces(self, start: int, stop: int):
        """(shard, shard-local start, shard-local stop, offset of the piece from ``start``) covering [start, stop)."""
        first = int(np.searchsorted(self.offsets, start, "right")) - 1
        pos = start
        for k in range(first, len(self.shards)):
            if pos >= stop:
                break
            base = int(self.offsets[k])
            end = min(stop, int(self.offsets[k + 1]))
            if end > pos:
                yield self.shards[k], pos - base, end - base, pos - start
            pos = max(pos, end)

    def read(self, start: int, out: np.ndarray, vocab_size: int | None = None) -> None:
        """Tokens [start, start + len(out)) of the stream into ``out`` (int64); a token id outside [0, vocab_size)
        is refused naming its file (the model's embedding has no row for it)."""
        assert 0 <= start and start + len(out) <= self.n_tokens, (start, len(out), self.n_tokens)
        for shard, a, b, at in self._pieces(start, start + len(out)):
            piece = out[at:at + b - a]
            piece[:] = shard.read_tokens(a, b)
            if vocab_size is not None and len(piece) and (piece.max() >= vocab_size or piece.min() < 0):
                bad = int(np.argmax((piece >= vocab_size) | (piece < 0)))
                raise CorpusError(f"{shard.bin_path}: token {a + bad} is {int(piece[bad])}, outside the model's "
                                  f"vocabulary [0, {vocab_size}): a corpus for another tokenizer or model")

    def read_rows(self, starts: np.ndarray, width: int, vocab_size: int | None = None) -> np.ndarray:
        """(len(starts), width) int64: the tokens [s, s + width) of each start (one read each, a row across two shards
        two); token ids outside [0, vocab_size) refused naming the file."""
        starts = np.asarray(starts, np.int64)
        out = np.empty((len(starts), width), np.int64)
        for row, start in enumerate(starts.tolist()):
            self.read(start, out[row])
        if vocab_size is not None and out.size and (out.max() >= vocab_size or out.min() < 0):
            row, col = np.argwhere((out >= vocab_size) | (out < 0))[0]
            at = int(starts[row]) + int(col)
            k = int(np.searchsorted(self.offsets, at, "right")) - 1
            raise CorpusError(f"{self.shards[k].bin_path}: token {at - int(self.offsets[k])} is {int(out[row, col])}, "
                              f"outside the model's vocabulary [0, {vocab_size}): a corpus for another tokenizer or "
                              f"model")
        return out

    def doc_starts(self, start: int, stop: int) -> np.ndarray:
        """Offsets (from ``start``) in [0, stop - start) at which a document starts."""
        parts = [shard.doc_starts(a, b) - a + at for shard, a, b, at in self._pieces(start, stop)]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)


@dataclass
class Corpus:
    """An opened corpus: its splits, where it came from and what identifies its content."""

    path: Path
    kind: str  # "llama-fp8" (a manifest) or "megatron"
    identity: str  # SHA-256 of the manifest (ours) or of the shards' names and sizes (Megatron's)
    splits: dict[str, CorpusSplit]
    tokenizer: dict | None  # the manifest's record of the tokenizer (ours)

    def describe(self) -> str:
        train = self.splits["train"]
        return (f"{self.path} ({self.kind} corpus: {train.n_docs:,} documents, {train.n_tokens:,} tokens in "
                f"{len(train.shards)} shard(s){', and a validation split' if 'validation' in self.splits else ''})")


def megatron_prefix(name: str) -> Path | None:
    """The ``.bin``/``.idx`` prefix a --dataset value names (``x``, ``x.bin`` or ``x.idx``), else None."""
    path = Path(os.path.expanduser(name))
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    return prefix if Path(f"{prefix}.idx").is_file() else None


def is_corpus(name: str) -> bool:
    """Whether a --dataset value is a tokenized corpus (ours, or Megatron's) rather than text."""
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return (path / mf.MANIFEST).is_file() or any(p.suffix == ".idx" for p in path.iterdir())
    return megatron_prefix(name) is not None


@lru_cache(maxsize=16)
def open_corpus(name: str, tokenizer_sha256: str | None = None) -> Corpus:
    """Open and check a corpus (see the module docstring); ``tokenizer_sha256``: the --tokenizer's, when given, must
    be the one the corpus was tokenized with. CorpusError naming the file on anything wrong."""
    path = Path(os.path.expanduser(name))
    if path.is_dir() and (path / mf.MANIFEST).is_file():
        corpus = _open_ours(path)
    elif path.is_dir():
        corpus = _open_megatron(path, sorted(p.with_suffix("") for p in path.iterdir() if p.suffix == ".idx"))
    elif megatron_prefix(name) is not None:
        prefix = megatron_prefix(name)
        corpus = _open_megatron(prefix.parent, [prefix], shown=prefix)
    else:
        raise CorpusError(f"--dataset={name!r}: neither a tokenized corpus folder (with {mf.MANIFEST}) nor a "
                          f"Megatron .bin/.idx prefix")
    if tokenizer_sha256 is not None and corpus.tokenizer is not None and \
            corpus.tokenizer["sha256"] != tokenizer_sha256:
        raise CorpusError(f"{path / mf.MANIFEST}: tokenized with the tokenizer {corpus.tokenizer.get('name')!r} "
                          f"(sha256 {corpus.tokenizer['sha256'][:12]}...), but --tokenizer has sha256 "
                          f"{tokenizer_sha256[:12]}...: its token ids would mean other text; give that tokenizer or "
                          f"leave --tokenizer out")
    return corpus


def _open_ours(root: Path) -> Corpus:
    body, raw = mf.read_manifest(root)
    where = root / mf.MANIFEST
    splits = {}
    for name, record in body["splits"].items():
        shards = []
        for entry in record["shards"]:
            shard = IndexedShard(mf.confined(root, entry["name"], where))
            for key, got in (("tokens", shard.n_tokens), ("documents", shard.n_docs),
                             ("bin_bytes", shard.bin_bytes), ("idx_bytes", shard.idx_path.stat().st_size)):
                if entry[key] != got:
                    raise CorpusError(f"{where}: shard {entry['name']!r} has {key}={entry[key]}, but its files hold "
                                      f"{got}; refused (forged or for other files: re-run llama_fp8 tokenize)")
            if shard.dtype.name != body["dtype"]:
                raise CorpusError(f"{where}: dtype {body['dtype']}, but {shard.idx_path.name} holds "
                                  f"{shard.dtype.name} tokens; refused")
            shards.append(shard)
        splits[name] = CorpusSplit(shards)
    if splits["train"].n_tokens == 0:
        raise CorpusError(f"{where}: the train split holds no tokens")
    return Corpus(root, "llama-fp8", hashlib.sha256(raw).hexdigest(), splits, body["tokenizer"])


def _open_megatron(root: Path, prefixes: list[Path], shown: Path | None = None) -> Corpus:
    if not prefixes:
        raise CorpusError(f"{root}: no .idx file")
    if len(prefixes) > MAX_MEGATRON_SHARDS:
        raise CorpusError(f"{root}: {len(prefixes)} .idx files, more than {MAX_MEGATRON_SHARDS}")
    shards = []
    for prefix in prefixes:
        mf.confined(root, prefix.name + ".idx", root)
        mf.confined(root, prefix.name + ".bin", root)
        shards.append(IndexedShard(prefix))
    split = CorpusSplit(shards)
    if split.n_tokens == 0:
        raise CorpusError(f"{root}: its .bin files hold no tokens")
    ident = json.dumps([(s.prefix.name, s.bin_bytes, s.idx_path.stat().st_size, s.n_sequences) for s in shards])
    return Corpus(shown or root, "megatron", hashlib.sha256(ident.encode()).hexdigest(), {"train": split}, None)
