"""Batches from tokenized corpora in one global sample order (``order.py``): the data position is one number.

A source is one corpus split cut into samples of T+1 consecutive tokens (sample i = tokens [i (T+1), (i+1)(T+1)) of
its stream; the last partial sample is left out). The order maps each global position to (source, sample): the blend
of --data_blend (or the one --dataset), then each source's seeded shuffle, epoch after epoch. Rank r of W reads
positions [P + r B, P + (r+1) B) of the next W B positions that are not skipped, and P moves past them.

State: {"position": P, "skip_samples": ranges, "settings": what P is a position in}. A resume at any world size or
--train_batch_size reads on from P; another corpus, --max_context_width, --seed or --data_blend is refused (the
position means other samples there). --skip_samples of the checkpoint and of the flags both apply.

With --num_workers N > 0, N threads read the next batches ahead (a batch is a function of its position, so what
they read ahead never changes the state, which counts only the batches handed out).
"""

from __future__ import annotations

import collections
import logging
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from llama_fp8.data.corpus import Corpus, CorpusSplit, is_corpus, open_corpus
from llama_fp8.data.doc_mask import doc_fields, starts_from_offsets
from llama_fp8.data.order import Blend, Permutation, Skips, parse_skips
from llama_fp8.data.tokenizer import load_tokenizer, tokenizer_sha256

log = logging.getLogger(__name__)
STATE_VERSION = 1
AHEAD_PER_WORKER = 2
STEPS_AT_ONCE = 64  # steps whose samples are looked up in one vectorized pass


class DataStateError(ValueError):
    """A saved data-loader position that does not fit this run's data settings."""


@dataclass
class Source:
    """One corpus split as samples of ``width`` tokens."""

    name: str  # as the user named it (a --dataset or --data_blend path)
    split: CorpusSplit
    width: int  # T + 1

    @property
    def n_samples(self) -> int:
        return self.split.n_tokens // self.width


class SampleOrder:
    """Global position -> a sample's tokens (and its document starts), for sources mixed by ``weights``."""

    def __init__(self, sources: list[Source], weights: list[float], seed: int, shuffle: bool,
                 vocab_size: int | None) -> None:
        for s in sources:
            if s.n_samples < 1:
                raise ValueError(f"{s.name}: {s.split.n_tokens} tokens, fewer than one sample of --max_context_width "
                                 f"+ 1 = {s.width}")
        self.sources, self.blend, self.seed, self.shuffle = sources, Blend(weights), seed, shuffle
        self.vocab_size = vocab_size
        self._perms: dict[tuple[int, int], Permutation] = {}

    def sample_ids(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample index within it) of each position."""
        src, k = self.blend.locate(positions)
        ids = np.empty_like(k)
        for s, source in enumerate(self.sources):
            mine = src == s
            if not mine.any():
                continue
            epoch, j = np.divmod(k[mine], source.n_samples)
            if self.shuffle:
                for e in np.unique(epoch):
                    at = epoch == e
                    j[at] = self._perm(s, int(e))(j[at])
            ids[mine] = j
        return src, ids

    def _perm(self, s: int, epoch: int) -> Permutation:
        key = (s, epoch)
        if key not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            self._perms[key] = Permutation(self.sources[s].n_samples, (self.seed, s, epoch))
        return self._perms[key]

    def read(self, positions: np.ndarray, with_starts: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(len, T+1) int64 tokens of the samples at ``positions``, and their document starts (bool) if asked."""
        return self.read_ids(*self.sample_ids(positions), with_starts)

    def read_ids(self, src: np.ndarray, ids: np.ndarray, with_starts: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """The samples ``ids`` of sources ``src`` (``sample_ids``), as ``read``."""
        width = self.sources[0].width
        blocks = np.empty((len(ids), width), np.int64)
        for s in np.unique(src):
            rows = np.nonzero(src == s)[0]
            blocks[rows] = self.sources[s].split.read_rows(ids[rows] * width, width, self.vocab_size)
        if not with_starts:
            return blocks, None
        offsets = [self.sources[s].split.doc_starts(i * width, (i + 1) * width) for s, i in zip(src.tolist(),
                                                                                               ids.tolist())]
        return blocks, starts_from_offsets(offsets, blocks.shape)


def make_batch(blocks: np.ndarray, starts: np.ndarray | None) -> dict[str, torch.Tensor]:
    if starts is not None:
        return doc_fields(blocks, starts)
    tokens = torch.from_numpy(blocks)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


class CorpusLoader:
    """Endless training batches of one data-parallel rank (module docstring); resumable at any world size."""

    def __init__(self, order: SampleOrder, settings: dict, batch_size: int, dp_rank: int, dp_world: int,
                 skips: Skips, doc_masking: bool, num_workers: int) -> None:
        self.order, self._settings, self._bsz = order, settings, batch_size
        self._rank, self._world, self._skips = dp_rank, dp_world, skips
        self._doc, self._workers = doc_masking, num_workers
        self._pos = 0  # the next global position after the batches handed out

    @property
    def position(self) -> int:
        return self._pos

    def _batch(self, mine: tuple[np.ndarray, np.ndarray]) -> dict[str, torch.Tensor]:
        return make_batch(*self.order.read_ids(*mine, self._doc))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        steps = self._steps(self._pos)
        if self._workers == 0:
            for mine, nxt in steps:
                batch = self._batch(mine)
                self._advance(nxt)
                yield batch
            return
        pool = ThreadPoolExecutor(self._workers, thread_name_prefix="llama-fp8-data")
        ahead: collections.deque = collections.deque()
        try:
            while True:
                while len(ahead) < AHEAD_PER_WORKER * self._workers:
                    mine, nxt = next(steps)
                    ahead.append((pool.submit(self._batch, mine), nxt))
                future, nxt = ahead.popleft()
                batch = future.result()
                self._advance(nxt)
                yield batch
        finally:
            if not sys.is_finalizing():  # a generator closed at exit: its threads are joined by the interpreter
                pool.shutdown(wait=False, cancel_futures=True)

    def _steps(self, pos: int) -> Iterator[tuple[tuple[np.ndarray, np.ndarray], int]]:
        """(this rank's samples: (source, sample) arrays, the position after the step) of each step from ``pos``,
        worked out STEPS_AT_ONCE steps at a time (one vectorized pass through the order instead of one per step)."""
        every, first = self._bsz * self._world, self._rank * self._bsz
        while True:
            if self._skips.ranges:  # the steps' positions, skipped ones left out
                steps = self._skips.take(pos, every * STEPS_AT_ONCE).reshape(STEPS_AT_ONCE, every)
                mine, ends = steps[:, first:first + self._bsz], steps[:, -1] + 1
            else:  # consecutive: computed, not listed (a large world's steps would be millions of positions)
                base = pos + every * np.arange(STEPS_AT_ONCE, dtype=np.int64)[:, None]
                mine, ends = base + first + np.arange(self._bsz), base[:, 0] + every
            src, ids = self.order.sample_ids(mine.reshape(-1))
            src, ids = src.reshape(STEPS_AT_ONCE, -1), ids.reshape(STEPS_AT_ONCE, -1)
            for i in range(STEPS_AT_ONCE):
                yield (src[i], ids[i]), int(ends[i])
            pos = int(ends[-1])

    def _advance(self, nxt: int) -> None:
        before, self._pos = self._pos, nxt
        if self._rank == 0:
            for a, b in self._skips.ranges:
                if before <= a < nxt:
                    log.warning("--skip_samples: left out global samples %d..%d (%d samples)", a, b - 1, b - a)

    def tokens_seen(self) -> dict[str, int]:
        """Input tokens of each source read by every rank together up to the position (skipped samples left out)."""
        blend = self.order.blend
        seen = blend.counts(self._pos) - self._skips.skipped_before(blend, self._pos)
        width = self.order.sources[0].width
        return {s.name: int(n) * (width - 1) for s, n in zip(self.order.sources, seen)}

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": "corpus", "position": self._pos,
                "skip_samples": [list(r) for r in self._skips.ranges], "settings": self._settings}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION or state.get("kind") != "corpus":
            raise DataStateError(f"data loader state has version={state.get('version')} kind={state.get('kind')!r}; "
                                 f"expected version={STATE_VERSION} kind='corpus' (was --dataset changed between "
                                 f"runs?)")
        for flag, saved in state.get("settings", {}).items():
            mine = self._settings.get(flag)
            if saved != mine:
                raise DataStateError(f"the data position was saved with --{flag}={saved!r}, this run has "
                                     f"--{flag}={mine!r}; the position is a position in that order: resume with "
                                     f"that --{flag}, or start a new --run_dir")
        position = state.get("position")
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise DataStateError(f"the saved data position {position!r} is not a sample count")
        saved = [(int(a), int(b)) for a, b in state.get("skip_samples", [])]
        if any(a < 0 or b <= a for a, b in saved):
            raise DataStateError(f"the saved --skip_samples {saved} are not ranges A:B with 0 <= A < B")
        self._skips = Skips(saved + self._skips.ranges)
        self._pos = position
        if self._skips.ranges and self._rank == 0:
            log.info("--skip_samples: global samples %s are left out (the checkpoint's and this run's)",
                     ", ".join(f"{a}..{b - 1}" for a, b in self._skips.ranges))


def corpus_settings(corpora: list[tuple[str, Corpus]], weights: list[float], blended: bool, seq_len: int,
                    seed: int) -> dict:
    """What a saved position is only valid for, by flag (a corpus by its content, wherever it lies now)."""
    ids = [f"{c.identity[:16]}" for _, c in corpora]
    source = {"data_blend": [[w, i] for w, i in zip(weights, ids)]} if blended else {"dataset": ids[0]}
    return {**source, "max_context_width": seq_len, "seed": seed}


# ------------------------------------------------------------------------------------ from the config
def parse_blend(text: str) -> list[tuple[float, str]]:
    """``--data_blend W1:PATH1,W2:PATH2,...`` -> [(weight, path)]; ValueError naming the flag."""
    out = []
    for part in (p.strip() for p in str(text).split(",")):
        weight, sep, path = part.partition(":")
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not sep or not path.strip() or not (w > 0 and np.isfinite(w)):
            raise ValueError(f"--data_blend={text!r}: {part!r} is not WEIGHT:PATH with a weight > 0 (e.g. "
                             f"0.7:/fsx/web,0.3:/fsx/code: each PATH a tokenized corpus)")
        out.append((w, path.strip()))
    if len({p for _, p in out}) != len(out):
        raise ValueError(f"--data_blend={text!r} names a corpus twice")
    return out


def corpus_sources(cfg) -> list[tuple[float, str]] | None:
    """The corpora a config trains on with their weights, or None when its --dataset is text (or synthetic)."""
    if cfg.data_blend:
        return parse_blend(cfg.data_blend)
    return [(1.0, cfg.dataset)] if cfg.dataset != "synthetic" and is_corpus(cfg.dataset) else None


def open_corpora(cfg) -> list[tuple[float, str, Corpus]]:
    """Open (and check) every corpus of the config; the --tokenizer, when given, must be the one each was made with."""
    sha = tokenizer_sha256(load_tokenizer(cfg.tokenizer)) if cfg.tokenizer else None
    return [(w, name, open_corpus(name, sha)) for w, name in corpus_sources(cfg)]


def check_corpus_config(cfg) -> None:
    """The corpus part of ``validate_data_config``: every corpus opens, fits the model's vocabulary and holds a sample."""
    for _, name, corpus in open_corpora(cfg):
        vocab = (corpus.tokenizer or {}).get("vocab_size")
        if vocab is not None and cfg.vocab_size is not None and vocab > cfg.vocab_size:
            raise ValueError(f"{name}: tokenized with a {vocab}-token tokenizer, more than the model's vocab_size="
                             f"{cfg.vocab_size}; use a model preset with vocab_size >= {vocab}")
        if corpus.splits["train"].n_tokens < cfg.max_context_width + 1:
            raise ValueError(f"{corpus.describe()}: fewer tokens than one sample of --max_context_width + 1 = "
                             f"{cfg.max_context_width + 1}")


def _order(cfg, split: str, shuffle: bool) -> tuple[SampleOrder, list[tuple[str, Corpus]], list[float]] | None:
    opened = open_corpora(cfg)
    if any(split not in c.splits for _, _, c in opened):
        return None
    sources = [Source(name, c.splits[split], cfg.max_context_width + 1) for _, name, c in opened]
    weights = [w for w, _, _ in opened]
    order = SampleOrder(sources, weights, cfg.seed, shuffle, cfg.vocab_size)
    return order, [(name, c) for _, name, c in opened], weights


def build_corpus_loader(cfg, dp_rank: int, dp_world: int) -> CorpusLoader:
    order, corpora, weights = _order(cfg, "train", shuffle=True)
    settings = corpus_settings(corpora, weights, bool(cfg.data_blend), cfg.max_context_width, cfg.seed)
    skips = Skips(parse_skips(cfg.skip_samples))
    if skips.ranges and dp_rank == 0:
        log.info("--skip_samples: global samples %s are left out", ", ".join(f"{a}..{b - 1}" for a, b in skips.ranges))
    return CorpusLoader(order, settings, cfg.train_batch_size, dp_rank, dp_world, skips, bool(cfg.doc_masking),
                        cfg.num_workers)


def corpus_val_batches(cfg, dp_rank: int, dp_world: int):
    """A function that yields this rank's validation batches from the corpora's validation splits (in stored order,
    the blend's pattern across them), or None when a corpus has no validation split."""
    got = _order(cfg, "validation", shuffle=False)
    if got is None:
        return None
    order, bsz = got[0], cfg.val_batch_size

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        step = 0
        while True:
            mine = step * bsz * dp_world + dp_rank * bsz + np.arange(bsz, dtype=np.int64)
            yield make_batch(*order.read(mine, bool(cfg.doc_masking)))
            step += 1

    return batches
