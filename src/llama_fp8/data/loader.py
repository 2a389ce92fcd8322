"""Training and validation batches: synthetic or packed real text, split by rank, resumable.

Batch format (every source): ``{"input_ids": LongTensor (B, T), "labels": LongTensor (B, T)}``.
Each row comes from one block of T+1 tokens: ``input_ids = block[:-1]``, ``labels = block[1:]``,
so the loss is ``cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)`` with no
further shift. Every label is a real next token (no -100 padding is ever produced).

Packing (``packing.py``): each document becomes ``[BOS] tokens [EOS]``, documents are concatenated in
numpy and cut into T+1 blocks; the leftover tokens start the next block.

Rank split: reader slot ``s = dp_rank * W + w`` of ``dp_world * W`` (W = max(1, num_workers)) owns a
disjoint set of documents (map-style: every n-th document; streaming: ``split_dataset_by_node``).
Physical DataLoader worker ``p`` plays slot ``(p + offset) % W`` so that a resumed loader continues
the round-robin order of the workers exactly where the interrupted one stopped.

Determinism: batches depend on the source, tokenizer, T, B, seed, dp_rank/dp_world and num_workers,
never on precision flags. Synthetic batches are independent of dp_world (see ``SyntheticLoader``).

A tokenized corpus (``llama_fp8 tokenize``, or Megatron's .bin/.idx) as --dataset, or several as --data_blend, is
read in one global sample order instead (``corpus_loader.py``): its position is one number, valid at any world size.
With --doc_masking every batch also holds ``position_ids`` restarting at each document (``doc_mask.py``).
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from llama_fp8.data import corpus_loader
from llama_fp8.data.corpus_loader import CorpusLoader, DataStateError
from llama_fp8.data.doc_mask import doc_fields, starts_after_eos
from llama_fp8.data.order import parse_skips
from llama_fp8.data.packing import PackSpec, SlotFactory
from llama_fp8.data.sources import SourceKey, open_sources
from llama_fp8.data.tokenizer import check_tokenizer, load_tokenizer

STATE_VERSION = 1
SYNTHETIC_MODULUS = 256  # synthetic token ids lie in [0, min(vocab_size, 256))
SYNTHETIC_MAX_STRIDE = 4  # synthetic sequences step by b in [1, 4]


def to_batch(blocks: np.ndarray, eos_id: int | None = None) -> dict[str, torch.Tensor]:
    """(B, T+1) token blocks -> the model's input/label tensors (B, T); with ``eos_id`` (--doc_masking) also the
    position ids of each document, which starts after an EOS (``doc_mask.py``)."""
    if eos_id is not None:
        return doc_fields(blocks, starts_after_eos(blocks, eos_id))
    tokens = torch.from_numpy(blocks.astype(np.int64))
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


# ------------------------------------------------------------------------------ reader factories

def real_factory(cfg: Any, dp_world: int, split: str, n_workers: int) -> SlotFactory:
    """Factory for --dataset != synthetic (``split`` "train" or "validation"); the config was checked by
    ``validate_data_config`` (the run plan calls it once, before anything is built)."""
    train = split == "train"
    spec = PackSpec(cfg.max_context_width, cfg.train_batch_size if train else cfg.val_batch_size,
                    cfg.seed, shuffle=train)
    return SlotFactory(SourceKey.from_cfg(cfg), cfg.tokenizer, spec, dp_world * n_workers, split)


# ------------------------------------------------------------------------------------- synthetic
def synthetic_sample(seed: int, stream: int, index: int, length: int, modulus: int) -> torch.Tensor:
    """Sample ``index`` of a stream: ``x_t = (a + b t) mod m``, a and b drawn from its own generator.

    Learnable in-context: after two tokens the stride b is known and the rest is predictable.
    """
    words = np.random.SeedSequence([seed & (2**64 - 1), stream, index]).generate_state(2, np.uint32)
    gen = torch.Generator().manual_seed((int(words[0]) << 31) ^ int(words[1]))
    a = torch.randint(0, modulus, (1,), generator=gen)
    b = torch.randint(1, SYNTHETIC_MAX_STRIDE + 1, (1,), generator=gen)
    return (a + b * torch.arange(length)) % modulus


def synthetic_batch(cfg: Any, stream: int, step: int, bsz: int, dp_rank: int,
                    dp_world: int) -> dict[str, torch.Tensor]:
    """Rows g = step * B * world + rank * B + i: the union over ranks is independent of world size."""
    modulus = min(int(cfg.vocab_size or SYNTHETIC_MODULUS), SYNTHETIC_MODULUS)
    first = step * bsz * dp_world + dp_rank * bsz
    rows = [synthetic_sample(cfg.seed, stream, g, cfg.max_context_width + 1, modulus)
            for g in range(first, first + bsz)]
    return to_batch(torch.stack(rows).numpy())


class SyntheticLoader:
    """Endless synthetic training batches; state = number of batches consumed."""

    def __init__(self, cfg: Any, dp_rank: int, dp_world: int) -> None:
        self._cfg, self._rank, self._world, self._step = cfg, dp_rank, dp_world, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            batch = synthetic_batch(self._cfg, 0, self._step, self._cfg.train_batch_size,
                                    self._rank, self._world)
            self._step += 1
            yield batch

    def state_dict(self) -> dict:
        """Batches consumed; the next global sample is ``step * batch_size * dp_world``."""
        return {"version": STATE_VERSION, "kind": "synthetic", "step": self._step, "dp_world": self._world,
                "batch_size": self._cfg.train_batch_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the same global sample, also with another data-parallel layout or batch size (a resume
        from (dp=2, tp=2) at (dp=4, tp=1) with half the batch reads the same samples); ``step`` is rescaled."""
        _check_state(state, "synthetic")
        step = int(state["step"])
        saved = int(state.get("dp_world", self._world)) * int(state.get("batch_size", self._cfg.train_batch_size))
        mine = self._world * self._cfg.train_batch_size
        if saved != mine:
            if (step * saved) % mine:
                raise DataStateError(f"the synthetic data position (sample {step * saved}) is not a whole number of "
                                     f"batches of {mine} samples (--train_batch_size x data-parallel ranks); resume "
                                     f"with a global batch that divides it")
            step = step * saved // mine
        self._step = step


# --------------------------------------------------------------------------------- train loader
_SHARED = ("remainder", "pending")  # state arrays sent from a worker only when they change


def _identity(item: Any) -> Any:
    return item


class _SlotIterable(torch.utils.data.IterableDataset):
    """Runs inside each DataLoader worker: physical worker p serves slot base + (p + offset) % W."""

    def __init__(self, factory: SlotFactory, base: int, n_workers: int, offset: int,
                 states: list[dict | None]) -> None:
        self.factory, self.base, self.n_workers = factory, base, n_workers
        self.offset, self.states = offset, states

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        local = ((info.id if info is not None else 0) + self.offset) % self.n_workers
        sent: dict[str, Any] = {}
        for blocks, state in self.factory.batches(self.base + local, self.states[local]):
            # The chunk's arrays travel to the main process once, not with every batch.
            delta = {k: None if k in _SHARED and sent.get(k) is v else v for k, v in state.items()}
            sent.update({k: state[k] for k in _SHARED})
            # numpy travels pickled in the worker pipe: cheaper than a shared-memory segment per tensor.
            yield {"blocks": blocks, "_local": local, "_state": delta}


class PackedLoader:
    """Endless packed batches of one data-parallel rank, resumable via state_dict/load_state_dict."""

    def __init__(self, factory: SlotFactory, dp_rank: int, dp_world: int, num_workers: int,
                 eos_id: int | None = None) -> None:
        self._factory, self._rank, self._world, self._eos = factory, dp_rank, dp_world, eos_id
        self._num_workers = num_workers
        self._slots = max(1, num_workers)
        self._states: list[dict | None] = [None] * self._slots
        self._consumed = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        dataset = _SlotIterable(self._factory, self._rank * self._slots, self._slots,
                                self._consumed % self._slots, list(self._states))
        if self._num_workers == 0:
            items: Any = iter(dataset)
        else:
            items = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=self._num_workers,
                                                collate_fn=_identity, prefetch_factor=4)
        for item in items:
            local, delta = item.pop("_local"), item.pop("_state")
            previous = self._states[local]
            self._states[local] = {k: previous[k] if k in _SHARED and v is None else v  # type: ignore[index]
                                   for k, v in delta.items()}
            self._consumed += 1
            yield to_batch(item["blocks"], self._eos)

    def state_dict(self) -> dict:
        """Position after the last batch handed out (prefetched batches are not counted)."""
        # Copies, so that a saved tensor does not drag the whole chunk's storage along.
        workers = [None if s is None else {**s, "remainder": torch.from_numpy(s["remainder"].copy()),
                                           "pending": torch.from_numpy(s["pending"][s["offset"]:].copy()),
                                           "offset": 0}
                   for s in self._states]
        return {"version": STATE_VERSION, "kind": "packed", "dp_rank": self._rank,
                "dp_world": self._world, "num_workers": self._num_workers, "settings": self._factory.settings(),
                "consumed": self._consumed, "workers": workers}

    def load_state_dict(self, state: dict) -> None:
        _check_state(state, "packed")
        for name, mine in (("dp_rank", self._rank), ("dp_world", self._world),
                           ("num_workers", self._num_workers)):
            if int(state[name]) != mine:
                flag = "--num_workers" if name == "num_workers" else f"{name} (the data-parallel layout)"
                raise DataStateError(f"the data loader position was saved with {flag}={state[name]}, this run "
                                     f"has {mine}; resume with the same value, or start a new --run_dir")
        for flag, saved in state.get("settings", {}).items():
            mine = self._factory.settings().get(flag)
            if saved != mine:
                raise DataStateError(f"the data loader position was saved with --{flag}={saved!r}, this run has "
                                     f"--{flag}={mine!r}; the position is only valid for the same data settings: "
                                     f"resume with --{flag}={saved!r}, or start a new --run_dir")
        self._consumed = int(state["consumed"])
        self._states = [None if s is None else {**s, "remainder": np.asarray(s["remainder"], np.int32),
                                                "pending": np.asarray(s["pending"], np.int32)}
                        for s in state["workers"]]


def _check_state(state: dict, kind: str) -> None:
    if state.get("version") != STATE_VERSION or state.get("kind") != kind:
        raise DataStateError(f"data loader state has version={state.get('version')} "
                         f"kind={state.get('kind')!r}; expected version={STATE_VERSION} kind={kind!r} "
                         "(was --dataset changed between runs?)")


class Fingerprinted:
    """This rank's batches, passed through, with a fingerprint of the samples handed out since the last ``take()``:
    the sum of each row's CRC32 of its ``input_ids``, modulo 2**32. Summed over the data-parallel ranks (the
    observer does, on logging steps) it is the fingerprint of every sample the step read, whatever the world size or
    the split of the global batch into ranks; logged per window in metrics.jsonl, it lets ``compare`` check that the
    two runs of an A/B pair trained on the same tokens, and a resumed run at another world size that it read what the
    uninterrupted run would have."""

    def __init__(self, batches: Any) -> None:
        self._it, self._sum = iter(batches), 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = next(self._it)
        rows = batch["input_ids"].contiguous().numpy()  # no copy: a CPU buffer
        self._sum = (self._sum + sum(zlib.crc32(row) for row in rows)) % 2**32
        return batch

    def take(self) -> int:
        """The fingerprint of the batches since the last call; starts a new window."""
        out, self._sum = self._sum, 0
        return out


def combine_fingerprints(sums: list[int], readers_per_batch: int = 1) -> str:
    """The step's fingerprint from every rank's ``Fingerprinted.take()`` (8 hex digits): ranks of one tensor or
    context-parallel group read the same batch, ``readers_per_batch`` of them, and count once."""
    total = sum(int(s) for s in sums)
    assert total % readers_per_batch == 0, (sums, readers_per_batch)
    return f"{(total // readers_per_batch) % 2**32:08x}"


# ----------------------------------------------------------------------------------- validation
class ValLoader:
    """Finite, re-iterable validation batches; the same batches every pass (cached after the first).

    Every rank yields exactly ``n_batches`` batches (its documents are repeated if too few), so a
    forward pass with collectives (FSDP) never waits on a rank that ran out of data.
    """

    def __init__(self, make: Callable[[], Iterator[dict[str, torch.Tensor]]], n_batches: int) -> None:
        self._make, self._n = make, n_batches
        self._cache: list[dict[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._cache is None:
            self._cache = list(itertools.islice(self._make(), self._n))
            assert len(self._cache) == self._n, (len(self._cache), self._n)
        return iter(self._cache)


# ------------------------------------------------------------------------------------ interface
def validate_data_config(cfg: Any, dp_world: int | None = None) -> None:
    """The one check of the data config (the run plan calls it before anything is built; the loaders
    trust it): a ValueError naming the flag, nothing downloaded for local paths. With ``dp_world``, also
    check that every reader slot of the training data gets documents."""
    for name in ("max_context_width", "train_batch_size", "val_batch_size", "vocab_size"):
        if getattr(cfg, name) is not None and int(getattr(cfg, name)) < 1:
            raise ValueError(f"--{name}={getattr(cfg, name)} must be >= 1")
    if cfg.num_workers < 0:
        raise ValueError(f"--num_workers={cfg.num_workers} must be >= 0")
    if cfg.data_blend and cfg.dataset != "synthetic":
        raise ValueError(f"--data_blend and --dataset={cfg.dataset!r}: give one of them (--data_blend names every "
                         f"corpus the run reads)")
    corpora = corpus_loader.corpus_sources(cfg)
    if cfg.skip_samples:
        parse_skips(cfg.skip_samples)
        if corpora is None:
            raise ValueError(f"--skip_samples {cfg.skip_samples} counts samples of a tokenized corpus's global order; "
                             f"--dataset={cfg.dataset!r} has none: tokenize it first (llama_fp8 tokenize)")
    if cfg.dataset == "synthetic" and corpora is None:
        if cfg.doc_masking:
            raise ValueError("--doc_masking keeps the documents of real text apart; --dataset=synthetic has none "
                             "(each sample is one sequence)")
        return
    if corpora is not None:
        _check_text_flags_unused(cfg)
        corpus_loader.check_corpus_config(cfg)
        return
    if not cfg.tokenizer:
        raise ValueError(f"--dataset={cfg.dataset!r} needs --tokenizer (a local folder or hub id); "
                         "only --dataset=synthetic and tokenized corpora work without one")
    check_tokenizer(load_tokenizer(cfg.tokenizer), cfg.tokenizer, cfg.vocab_size)
    open_sources(SourceKey.from_cfg(cfg))
    if dp_world is not None:
        _check_reader_slots(cfg, dp_world)


# Flags that say how text becomes documents: a tokenized corpus was cut at tokenize time (they go to llama_fp8
# tokenize); with a corpus they would do nothing, so they are refused. (flag, its value when not given)
TEXT_FLAGS = (("dataset_config_name", None), ("text_field", "text"), ("data_files", None), ("val_data_files", None),
              ("val_fraction", 0.0), ("streaming", True))


def _check_text_flags_unused(cfg: Any) -> None:
    given = [f"--{k}={getattr(cfg, k)!r}" for k, default in TEXT_FLAGS if getattr(cfg, k) != default]
    if given:
        raise ValueError(f"{', '.join(given)}: how text becomes documents is decided when it is tokenized; "
                         f"{'--data_blend' if cfg.data_blend else '--dataset'} names tokenized corpora: give "
                         f"{'them' if len(given) > 1 else 'it'} to llama_fp8 tokenize instead, not to train")


def _check_reader_slots(cfg: Any, dp_world: int) -> None:
    src, n_slots = open_sources(SourceKey.from_cfg(cfg)), dp_world * max(1, cfg.num_workers)
    n_docs = src.n_docs("train")
    if n_docs is not None and n_docs < n_slots:
        raise ValueError(f"--dataset={cfg.dataset!r} has {n_docs} training documents, fewer than "
                         f"dp_world * max(1, --num_workers) = {n_slots} reader slots")


def _eos(cfg: Any) -> int | None:
    """The EOS id that ends each document, when --doc_masking needs the boundaries (on-the-fly packing)."""
    return int(load_tokenizer(cfg.tokenizer).eos_token_id) if cfg.doc_masking else None


def build_train_loader(cfg: Any, dp_rank: int, dp_world: int) -> SyntheticLoader | PackedLoader | CorpusLoader:
    """Endless training batches of this data-parallel rank (see the module docstring)."""
    assert 0 <= dp_rank < dp_world, (dp_rank, dp_world)
    if corpus_loader.corpus_sources(cfg) is not None:
        return corpus_loader.build_corpus_loader(cfg, dp_rank, dp_world)
    if cfg.dataset == "synthetic":
        return SyntheticLoader(cfg, dp_rank, dp_world)
    factory = real_factory(cfg, dp_world, "train", max(1, cfg.num_workers))
    if cfg.num_workers > 0:
        # Workers are forked processes with one tokenizer thread each; avoids the fork warning.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return PackedLoader(factory, dp_rank, dp_world, cfg.num_workers, _eos(cfg))


def build_val_loader(cfg: Any, dp_rank: int, dp_world: int) -> ValLoader | None:
    """``cfg.validation_batches`` batches of held-out data for this rank, or None if there is none."""
    assert 0 <= dp_rank < dp_world, (dp_rank, dp_world)
    if cfg.validation_batches < 1:
        return None
    if corpus_loader.corpus_sources(cfg) is not None:
        make = corpus_loader.corpus_val_batches(cfg, dp_rank, dp_world)
        return None if make is None else ValLoader(make, cfg.validation_batches)
    if cfg.dataset == "synthetic":
        return ValLoader(lambda: (synthetic_batch(cfg, 1, i, cfg.val_batch_size, dp_rank, dp_world)
                                  for i in itertools.count()), cfg.validation_batches)
    src = open_sources(SourceKey.from_cfg(cfg))
    if src.val is None:
        return None
    n_docs = src.n_docs("validation")
    # A validation set smaller than the world is read whole by every rank instead of split.
    world = dp_world if n_docs is None or n_docs >= dp_world else 1
    factory = real_factory(cfg, world, "validation", 1)
    eos = _eos(cfg)
    return ValLoader(lambda: (to_batch(blocks, eos) for blocks, _ in factory.batches(dp_rank % world, None)),
                     cfg.validation_batches)
