"""Documents -> packed (B, T+1) token blocks for one reader slot, with an exact resume position.

Each document becomes ``[BOS] tokens [EOS]`` (BOS only if the tokenizer defines one that differs from
EOS); documents are tokenized a chunk at a time (one batched fast-tokenizer call), concatenated in
numpy and cut into T+1 blocks; the leftover tokens start the next block. Blocks made from one chunk
are permuted before batching (training). ``loader.py`` turns slots into rank-disjoint DataLoaders.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from llama_fp8.data.readers import MapDocReader, StreamDocReader
from llama_fp8.data.sources import SourceKey, open_sources
from llama_fp8.data.tokenizer import load_tokenizer

CHUNK_DOCS = 128  # documents per batched tokenizer call


def pack_documents(token_lists: list[list[int]], bos_id: int | None, eos_id: int) -> np.ndarray:
    """Token lists of documents -> one int32 stream ``[BOS] doc [EOS] [BOS] doc [EOS] ...``.

    Vectorized: one ``fromiter`` over all tokens, separators written by index, no list concatenation.
    """
    n_docs = len(token_lists)
    lengths = np.fromiter(map(len, token_lists), dtype=np.int64, count=n_docs)
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int32,
                       count=int(lengths.sum()))
    extra = 1 if bos_id is None else 2
    ends = np.cumsum(lengths + extra)  # exclusive end of each document incl. separators
    out = np.empty(int(ends[-1]) if n_docs else 0, dtype=np.int32)
    is_token = np.ones(len(out), dtype=bool)
    is_token[ends - 1] = False
    out[ends - 1] = eos_id
    if bos_id is not None:
        starts = ends - lengths - extra
        is_token[starts] = False
        out[starts] = bos_id
    out[is_token] = flat
    return out


class Encoder:
    """Batched fast-tokenizer call without special tokens (picklable, for DataLoader workers)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.eos_id = int(eos)
        self.bos_id = None if bos is None or bos == eos else int(bos)

    def __call__(self, texts: list[str]) -> np.ndarray:
        return self.documents(texts)[0]

    def documents(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The packed stream of the texts and each document's length in it (its BOS and EOS included)."""
        texts = [t for t in texts if t]  # skip empty/missing documents (e.g. blank .txt lines)
        if not texts:
            return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            ids = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        else:
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        extra = 1 if self.bos_id is None else 2
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + extra
        return pack_documents(ids, self.bos_id, self.eos_id), lengths


@dataclass(frozen=True)
class PackSpec:
    """How one reader slot's documents become batches."""

    seq_len: int  # T
    batch_size: int  # B
    seed: int
    shuffle: bool  # shuffle documents per epoch and blocks per chunk (train) or not (validation)
    cycle: bool = True  # restart the documents at the end (train, and validation with fewer documents
    # than --validation_batches need); False: read them once (tests read a stream exactly once)


def _empty_state(spec: PackSpec) -> dict:
    return {"reader": None, "chunk": 0, "remainder": np.empty(0, np.int32),
            "pending": np.empty((0, spec.seq_len + 1), np.int32), "offset": 0}


def packed_batches(reader: Any, encode: Encoder, spec: PackSpec, slot: int,
                   state: dict | None) -> Iterator[tuple[np.ndarray, dict]]:
    """Yield ((B, T+1) int32 blocks, state after this batch); ``state`` resumes exactly.

    The state holds the reader position, the packing remainder (< T+1 tokens) and the blocks of
    the current chunk not yet batched (``pending[offset:]``), so nothing is re-read or
    re-tokenized on resume. The arrays are shared between consecutive states, never copied here
    and never written in place.
    """
    st = dict(state) if state else _empty_state(spec)
    rem, pending = np.asarray(st["remainder"], np.int32), np.asarray(st["pending"], np.int32)
    chunk, offset, width, bsz = int(st["chunk"]), int(st["offset"]), spec.seq_len + 1, spec.batch_size
    docs = reader.read(st["reader"], cycle=spec.cycle)
    reader_pos = st["reader"]
    while True:
        while len(pending) - offset >= bsz:
            offset += bsz
            yield pending[offset - bsz:offset], {"reader": reader_pos, "chunk": chunk, "remainder": rem,
                                                 "pending": pending, "offset": offset}
        try:
            texts, reader_pos = next(docs)
        except StopIteration:
            return  # finite pass (validation): the partial batch and remainder are dropped
        stream = np.concatenate([rem, encode(texts)])
        n_blocks = len(stream) // width
        blocks = stream[: n_blocks * width].reshape(n_blocks, width)
        rem = stream[n_blocks * width:]
        if spec.shuffle and n_blocks > 1:
            rng = np.random.default_rng([spec.seed & (2**63 - 1), slot, chunk])
            blocks = blocks[rng.permutation(n_blocks)]
        chunk += 1
        pending, offset = (np.concatenate([pending[offset:], blocks]) if offset < len(pending) else blocks), 0


@dataclass
class SlotFactory:
    """Everything a DataLoader worker needs to build its reader (picklable)."""

    key: SourceKey
    tokenizer_name: str
    spec: PackSpec
    n_slots: int
    split: str  # "train" or "validation"

    def reader(self, slot: int) -> Any:
        src = open_sources(self.key)
        ds, ids = (src.train, src.train_ids) if self.split == "train" else (src.val, src.val_ids)
        if hasattr(ds, "__len__"):
            return MapDocReader(ds, ids, src.text_field, slot, self.n_slots, self.spec.seed,
                                self.spec.shuffle, CHUNK_DOCS)
        return StreamDocReader(ds, src.text_field, slot, self.n_slots, CHUNK_DOCS)

    def settings(self) -> dict[str, Any]:
        """The flags a saved reader position is only valid for (by flag name). --train_batch_size is
        not one: the saved pending blocks are whole T+1 rows and are batched by the new B."""
        k = self.key
        return {"dataset": k.dataset, "dataset_config_name": k.config_name, "text_field": k.text_field,
                "data_files": k.data_files, "val_data_files": k.val_data_files, "val_fraction": k.val_fraction,
                "streaming": k.streaming, "tokenizer": self.tokenizer_name,
                "max_context_width": self.spec.seq_len, "seed": self.spec.seed}

    def batches(self, slot: int, state: dict | None) -> Iterator[tuple[np.ndarray, dict]]:
        encode = Encoder(load_tokenizer(self.tokenizer_name))
        return packed_batches(self.reader(slot), encode, self.spec, slot, state)
