"""Published FP8 and BF16 GEMM figures by shape, per GPU, each with its source: what ``predict.py`` turns into a
predicted step-time speed-up. Imports nothing of the package (data and lookups only).

A linear layer of forward shape (M, K, N) (M tokens, K in features, N out features) runs three GEMMs per training step
(forward, input gradient, weight gradient), 6 M K N FLOPs. The figures are for that whole linear (its three GEMMs and,
for FP8, the scaling and casting around them), measured against the same layer in BF16:

- torchao rowwise, H100: a measured grid, M, K, N each 1024 ... 32768 (216 shapes), read by trilinear interpolation in
  log2 of the shape, and outside it at its edge. A shape below the grid gains at most what its edge gains, one above it
  at least (the speed-up grows with M, K, N: torchao's derivation in its README's Performance section), so an edge
  value is an upper or a lower bound and the lookup says which.
- torchao tensorwise, H100: torchao published two shapes of its tensorwise table in text. Their ratio to the rowwise
  grid at the same shapes (2.0 at the small one, 1.30 at the large one) is interpolated in log2(M K N), clamped
  outside them, and multiplies the rowwise grid: a derived figure, stated as such.
- Transformer Engine (per-tensor delayed scaling, 2023), H100: four LLaMa 2 70B shapes at M = 16384 measured against
  BF16 in float8_experimental's benchmark; the rowwise grid times their geometric-mean ratio to it (1.29), derived
  likewise. TE's current scaling has no published by-shape figure: it is given TE delayed's, named as such.
- BF16 throughput (for how long a linear takes beside attention, norms and the LM head): the same benchmark's BF16
  times of the four shapes, the nearest one by log2 distance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GRID = (1024, 2048, 4096, 8192, 16384, 32768)

ROWWISE_SOURCE = ("torchao docs/static/fp8-rowwise-perf.png (pytorch/ao#2312, 2025-06-06), the rowwise table of "
                  "torchao/float8/README.md's Performance section: LayerNorm -> Linear -> Sigmoid forward + backward, "
                  "speed-up over BF16 by forward M, K, N on an NVIDIA H100, dynamic row-wise scaling, torch.compile, "
                  "PyTorch 2.8.0a0+git48807d5")
# rows: M, K; columns: N = GRID (transcribed from the table)
_ROWWISE_H100 = """
1024 1024 0.42 0.42 0.50 0.51 0.56 0.56
1024 2048 0.40 0.38 0.42 0.50 0.50 0.56
1024 4096 0.48 0.43 0.46 0.53 0.57 0.60
1024 8192 0.45 0.48 0.54 0.62 0.60 0.62
1024 16384 0.46 0.48 0.54 0.60 0.60 0.61
1024 32768 0.45 0.50 0.55 0.60 0.62 0.65
2048 1024 0.43 0.43 0.48 0.55 0.62 0.65
2048 2048 0.38 0.45 0.58 0.65 0.72 0.75
2048 4096 0.43 0.50 0.68 0.78 0.81 0.82
2048 8192 0.46 0.58 0.73 0.82 0.87 0.89
2048 16384 0.48 0.62 0.75 0.83 0.84 0.85
2048 32768 0.50 0.64 0.75 0.84 0.83 0.99
4096 1024 0.45 0.47 0.57 0.66 0.72 0.76
4096 2048 0.43 0.53 0.70 0.83 0.90 0.91
4096 4096 0.44 0.64 0.84 1.01 1.01 1.04
4096 8192 0.53 0.72 0.91 1.01 1.07 1.13
4096 16384 0.53 0.74 0.92 1.05 1.10 1.18
4096 32768 0.54 0.75 0.93 1.02 1.17 1.18
8192 1024 0.48 0.52 0.65 0.77 0.83 0.84
8192 2048 0.45 0.64 0.82 1.01 1.03 1.06
8192 4096 0.52 0.76 1.00 1.13 1.17 1.19
8192 8192 0.59 0.85 1.05 1.20 1.31 1.41
8192 16384 0.58 0.82 1.03 1.22 1.37 1.40
8192 32768 0.59 0.82 1.04 1.30 1.36 1.46
16384 1024 0.48 0.58 0.73 0.86 0.85 0.89
16384 2048 0.51 0.70 0.90 1.05 1.07 1.15
16384 4096 0.57 0.79 1.02 1.20 1.26 1.40
16384 8192 0.61 0.87 1.08 1.33 1.39 1.49
16384 16384 0.59 0.83 1.07 1.34 1.42 1.55
16384 32768 0.60 0.85 1.16 1.35 1.48 1.72
32768 1024 0.51 0.62 0.77 0.87 0.88 0.94
32768 2048 0.54 0.73 0.91 1.08 1.14 1.27
32768 4096 0.59 0.81 1.04 1.28 1.35 1.49
32768 8192 0.63 0.87 1.11 1.41 1.50 1.62
32768 16384 0.60 0.83 1.16 1.39 1.49 1.73
32768 32768 0.63 0.93 1.16 1.48 1.70 1.52
"""

TENSORWISE_SOURCE = ("torchao/float8/README.md, Performance section (pytorch/ao#1986, 2025-04-01): the tensorwise "
                     "table on an NVIDIA H100 in text: M, K, N = 1024, 2048, 1024: speed-up 0.80; 4096, 8192, 16384: "
                     "1.39")
TENSORWISE_H100 = ((1024, 2048, 1024, 0.80), (4096, 8192, 16384, 1.39))

TE_SOURCE = ("meta-pytorch/float8_experimental#116 (2023-10-02): its bench_linear_float8 benchmark with --compile, LLaMa 2 "
             "70B shapes on the H100 SXM its peak constants name; ref_time_sec (BF16 linear forward + backward) and "
             "te_fp8_speedup (Transformer Engine's Linear, delayed scaling)")
# M, K, N, BF16 seconds of the linear's forward + backward, TE's speed-up over it
TE_H100 = ((16384, 8192, 1280, 0.00214382, 1.06105), (16384, 1024, 8192, 0.00187812, 1.07844),
           (16384, 8192, 7168, 0.00999977, 1.56409), (16384, 3584, 8192, 0.00522039, 1.41388))

ATTENTION_SOURCE = ("Shah et al., FlashAttention-3 (arXiv:2407.08608), abstract: FlashAttention-2 (PyTorch's SDPA flash "
                    "kernel) reaches 35 % utilization on an H100")
ATTENTION_UTILIZATION = {"H100": 0.35}
HBM_SOURCE = {"H100": "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 3.35 TB/s",
              "H200": "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 4.8 TB/s"}
HBM_TBS = {"H100": 3.35, "H200": 4.8}

FIGURES_OF = {"H100": "H100", "H200": "H100"}
"""The GPU whose published by-shape figures stand for each GPU of ``estimate/gpus.py``: H200 has H100's tensor-core
peaks (the datasheets' dense figures are equal), so H100's figures stand for it, stated."""

E2E_SOURCE = "torchao docs/source/workflows/training.md (pytorch/ao, 2026-02-02), e2e training benchmarks (torchtitan)"
PUBLISHED_E2E = {
    "H100": ("Llama3-8b on 8 x H100, batch 1 x 8192, torch.compile, FSDP2, per-op SAC: tensorwise with float8 "
             "all-gather +25.03 %, rowwise +10.05 % tokens/s over BF16"),
    "B200": ("Llama3-8b on 8 power-limited B200, batch 1 x 8192, torch.compile, FSDP2, per-op SAC: tensorwise "
             "(float8 all-gather) +25.4 %, mxfp8_cublas +20.0 %, rowwise +4.0 % tokens/s over BF16"),
}


@dataclass(frozen=True)
class Figure:
    """A linear's FP8 speed-up over BF16 at one shape, how it was read, and where it comes from."""

    value: float
    how: str     # "interpolated", "edge: at most", "edge: at least", "derived", ...
    source: str

    @property
    def bound(self) -> str:
        """'<=' (an upper bound), '>=' (a lower bound) or '~'."""
        return "<=" if "at most" in self.how else ">=" if "at least" in self.how else "~"


def _grid() -> dict[tuple[int, int], tuple[float, ...]]:
    rows = {}
    for line in _ROWWISE_H100.strip().splitlines():
        m, k, *vals = line.split()
        rows[(int(m), int(k))] = tuple(float(v) for v in vals)
    return rows


ROWWISE_H100 = _grid()
_LOG = [math.log2(g) for g in GRID]


def _axis(x: float) -> tuple[int, float, int]:
    """(index below, weight of the one above, -1/0/+1: below the grid, inside, above) on one axis, in log2."""
    lx = math.log2(x)
    if lx <= _LOG[0]:
        return 0, 0.0, -1 if lx < _LOG[0] else 0
    if lx >= _LOG[-1]:
        return len(GRID) - 2, 1.0, 1 if lx > _LOG[-1] else 0
    i = max(j for j in range(len(GRID) - 1) if _LOG[j] <= lx)
    return i, (lx - _LOG[i]) / (_LOG[i + 1] - _LOG[i]), 0


def rowwise(m: int, k: int, n: int) -> Figure:
    """The rowwise grid at (M, K, N) (module docstring)."""
    (im, wm, sm), (ik, wk, sk), (inn, wn, sn) = _axis(m), _axis(k), _axis(n)
    value = 0.0
    for dm, fm in ((0, 1 - wm), (1, wm)):
        for dk, fk in ((0, 1 - wk), (1, wk)):
            row = ROWWISE_H100[(GRID[im + dm], GRID[ik + dk])]
            value += fm * fk * ((1 - wn) * row[inn] + wn * row[inn + 1])
    sides = {s for s in (sm, sk, sn) if s}
    how = ("interpolated" if not sides else "edge: at most (a shape below the table)" if sides == {-1}
           else "edge: at least (a shape above the table)" if sides == {1} else "edge (below in one dimension, above "
           "in another)")
    return Figure(value, how, ROWWISE_SOURCE)


def _ratio_tensorwise(m: int, k: int, n: int) -> float:
    """tensorwise over rowwise, interpolated in log2(M K N) between torchao's two published tensorwise shapes."""
    pts = sorted((math.log2(a * b * c), v / rowwise(a, b, c).value) for a, b, c, v in TENSORWISE_H100)
    x = math.log2(m * k * n)
    (x0, r0), (x1, r1) = pts
    t = min(max((x - x0) / (x1 - x0), 0.0), 1.0)
    return r0 + t * (r1 - r0)


def te_ratio() -> float:
    """TE's published speed-up over the rowwise grid's at its four shapes, their geometric mean."""
    logs = [math.log(s / rowwise(m, k, n).value) for m, k, n, _, s in TE_H100]
    return math.exp(sum(logs) / len(logs))


def lookup(recipe: str, gpu: str, m: int, k: int, n: int) -> Figure | None:
    """The published (or derived) FP8 speed-up of a linear of forward shape (M, K, N) for ``recipe`` on ``gpu``;
    None when there is no figure for that recipe and GPU."""
    if FIGURES_OF.get(gpu) != "H100":
        return None
    base = rowwise(m, k, n)
    if recipe == "rowwise":
        return base
    if recipe == "tensorwise":
        return Figure(base.value * _ratio_tensorwise(m, k, n), f"derived: the rowwise table ({base.how}) times "
                      "tensorwise/rowwise at torchao's two published tensorwise shapes, interpolated in log2(M K N)",
                      f"{TENSORWISE_SOURCE}; {ROWWISE_SOURCE}")
    if recipe in ("delayed", "current"):
        named = "" if recipe == "delayed" else "TE delayed scaling's figure (none published for current scaling); "
        return Figure(base.value * te_ratio(), f"derived: {named}the rowwise table ({base.how}) times TE's "
                      f"geometric-mean ratio to it at its four published shapes ({te_ratio():.3g})",
                      f"{TE_SOURCE}; {ROWWISE_SOURCE}")
    return None


def bf16_tflops(gpu: str, m: int, k: int, n: int) -> tuple[float, str] | None:
    """(BF16 TFLOPS of a linear's forward + backward at the nearest published shape, its source); None: no figure."""
    if FIGURES_OF.get(gpu) != "H100":
        return None

    def dist(p) -> float:
        return sum(abs(math.log2(a / b)) for a, b in zip(p[:3], (m, k, n)))
    pm, pk, pn, seconds, _ = min(TE_H100, key=dist)
    return 6 * pm * pk * pn / seconds / 1e12, f"{TE_SOURCE} (BF16 at the nearest shape, ({pm}, {pk}, {pn}))"
