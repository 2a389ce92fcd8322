"""The global sample order of a tokenized corpus: which sample the run reads at each global position.

Position g (0, 1, 2, ...) counts samples across the whole run, every data-parallel rank together: step s reads
positions [s * G, (s + 1) * G) with G = --train_batch_size x data-parallel ranks, rank r the B of them from r * B.
The data position of a run is therefore one number, the same at any world size: a resume with other ranks or
another --train_batch_size (the same G) reads exactly what the uninterrupted run would have read next.

- ``Blend`` maps a position to (source, k): the k-th sample of that source (one source: itself). Sources are
  interleaved by a fixed pattern in which each source's samples are spread evenly (the k-th sample of a source of
  share w sits at time (k + 1/2) / w): over any prefix every source is within one sample of its weight.
- ``Permutation`` maps k to the sample a source reads: a seeded shuffle of its samples per epoch, a Feistel
  network over the indices (computed per index: no array of the corpus's size in memory, however large it is).
- ``Skips`` takes global positions out (``--skip_samples A:B``: positions A to B-1, e.g. the batches before a loss
  spike), so a run after a skip reads on from B.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np

ROUNDS = 6  # alternating Feistel rounds, three on each part (4 balanced rounds already give a strong permutation)
MAX_PERIOD = 4096  # longest blend pattern; weights whose exact pattern is longer are rounded to this many samples
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a well-mixed 64-bit hash (uint64 array arithmetic wraps, silently, by design)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


class Permutation:
    """A seeded bijection of [0, n), one index at a time (vectorized): an alternating Feistel network over the bits
    of n - 1 (each round XORs one part of the index with a keyed hash of the other part, which is undone by the same
    XOR: a bijection of [0, 2^bits)), and cycle walking (an output >= n is encrypted again) to stay inside [0, n).
    2^bits < 2n, so an index is encrypted twice on average. No array of n entries: memory does not grow with n."""

    def __init__(self, n: int, key: tuple[int, ...]) -> None:
        assert n >= 1, n
        bits = max(2, (n - 1).bit_length())
        self.n = n
        self.low = bits // 2  # the low part's bits; the high part has the rest
        self.low_mask = np.uint64((1 << self.low) - 1)
        self.high_mask = np.uint64((1 << (bits - self.low)) - 1)
        self.keys = np.random.SeedSequence([k & (2**63 - 1) for k in key]).generate_state(ROUNDS, np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.low)
        high, low = x >> shift, x & self.low_mask
        for r, k in enumerate(self.keys):
            if r % 2:
                high = high ^ (_mix(low ^ k) & self.high_mask)
            else:
                low = low ^ (_mix(high ^ k) & self.low_mask)
        return (high << shift) | low

    def __call__(self, i: np.ndarray) -> np.ndarray:
        out = self._encrypt(np.asarray(i, np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():  # the domain is < 2n: a few rounds at most
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


def _shares(weights: list[float]) -> list[int]:
    """Integer shares proportional to ``weights`` (exact for decimal weights whose pattern fits MAX_PERIOD)."""
    exact = [Fraction(str(w)) for w in weights]
    total = sum(exact)
    norm = [w / total for w in exact]
    period = math.lcm(*(f.denominator for f in norm))
    if period <= MAX_PERIOD:
        return [int(f * period) for f in norm]
    raw = [float(f) * MAX_PERIOD for f in norm]  # largest remainders, every source at least one sample
    shares = [max(1, int(r)) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)[:MAX_PERIOD - sum(shares)]:
        shares[i] += 1
    return shares


class Blend:
    """Position -> (source, k) for sources mixed by ``weights`` (module docstring)."""

    def __init__(self, weights: list[float]) -> None:
        self.shares = _shares(weights)
        self.period = sum(self.shares)
        slots = sorted((Fraction(2 * k + 1, 2 * w), s, k) for s, w in enumerate(self.shares) for k in range(w))
        self.pattern = np.array([s for _, s, _ in slots], np.int64)  # source of each position of a period
        self.rank = np.array([k for _, _, k in slots], np.int64)  # its sample's index within the period
        self._prefix = np.zeros((self.period + 1, len(self.shares)), np.int64)  # samples per source before j
        self._prefix[1:] = np.cumsum(np.eye(len(self.shares), dtype=np.int64)[self.pattern], axis=0)

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q, j = np.divmod(np.asarray(g, np.int64), self.period)
        src = self.pattern[j]
        return src, q * np.asarray(self.shares, np.int64)[src] + self.rank[j]

    def counts(self, g: int) -> np.ndarray:
        """Samples of each source among positions [0, g)."""
        q, j = divmod(int(g), self.period)
        return q * np.asarray(self.shares, np.int64) + self._prefix[j]


def parse_skips(text: str | None, flag: str = "--skip_samples") -> list[tuple[int, int]]:
    """``A:B[,C:D...]`` -> sorted, merged half-open ranges [A, B); ValueError naming the flag."""
    if not text:
        return []
    ranges = []
    for part in (p.strip() for p in str(text).split(",")):
        a, sep, b = part.partition(":")
        try:
            lo, hi = int(a), int(b)
        except ValueError:
            lo = hi = -1
        if not sep or lo < 0 or hi <= lo:
            raise ValueError(f"{flag}={text!r}: {part!r} is not A:B with 0 <= A < B (global sample positions A to "
                             f"B-1, e.g. 51200:53248)")
        ranges.append((lo, hi))
    return merge_skips(ranges)


def merge_skips(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class Skips:
    """Global positions left out of the order."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = merge_skips(ranges)
        self._starts = [a for a, _ in self.ranges]

    def take(self, start: int, count: int) -> np.ndarray:
        """The first ``count`` positions >= ``start`` that are not skipped."""
        parts, pos, left = [], int(start), count
        while left > 0:
            i = bisect.bisect_right(self._starts, pos) - 1
            if i >= 0 and pos < self.ranges[i][1]:
                pos = self.ranges[i][1]  # inside a skipped range: jump to its end
                continue
            nxt = self._starts[i + 1] if i + 1 < len(self._starts) else pos + left
            n = min(left, nxt - pos)
            parts.append(np.arange(pos, pos + n, dtype=np.int64))
            pos, left = pos + n, left - n
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def skipped_before(self, blend: Blend, position: int) -> np.ndarray:
        """Per source, the samples among skipped positions below ``position``."""
        out = np.zeros(len(blend.shares), np.int64)
        for a, b in self.ranges:
            if a < position:
                out += blend.counts(min(b, position)) - blend.counts(a)
        return out
