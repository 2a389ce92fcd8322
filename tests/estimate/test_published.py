"""The estimate's GPU terms and margin against published peaks (tests/estimate/published.py: torchtitan's H100
tables, estimated for the program that produced them as far as this repository can build it).

The band: the estimate with its margin (tracked peak + the GPU terms + 20 %) at or above each published reserved peak,
so that "fits" is not said of a configuration that ran out of memory, and at most 15 % above it, so that the margin
does not turn what runs into "does not fit". Measured (December 2024 runs, eager estimates): 1.02 to 1.07. The
estimator before the terms were set from the published measurements (an H100 of nvidia-smi's 81,559 MiB, 640 MiB of
NCCL buffers without NVLS, a 5 % margin) gave 0.90 to 0.94 of the same peaks: below the band.

In-sample: the 20 % margin (terms.ALLOCATOR_MARGIN) was set from these same four rows (by docs/estimate.md's table, any
margin from 17 % to 29 % puts all four in the band), so this test guards against the terms drifting, not a validation of the margin on
runs it was not fitted to; docs/estimate.md says so. No published row outside these four is checked yet."""

from __future__ import annotations

import pytest
from published import ROWS, estimate, ratio, torchtitan_like

from llama_fp8.estimate import terms

pytestmark = pytest.mark.slow

LOW, HIGH = 1.0, 1.15


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_the_estimate_with_its_margin_is_in_the_published_peaks_band(row):
    with torchtitan_like():
        e = estimate(row)
    got = ratio(e, row)
    needed = e.verdict.needed / 2**30
    assert LOW <= got <= HIGH, f"{row.name}: needed {needed:.2f} GiB + margin, {got:.3f} x the published {row.reserved_gib}"
    # the old terms and margin on the same tracked peak: below the published peak, which the band catches
    m = e.measurement
    comms = terms.communicators(m.collectives, m.group_ranks)
    old_needed = m.peak_bytes + 2**30 + 640 * 2**20 * len(comms) + 32 * 2**20 + m.fp8_operand_bytes
    old = (old_needed + 0.05 * m.peak_bytes) / (row.reserved_gib * 2**30)
    assert old < LOW, f"{row.name}: the old terms gave {old:.3f}"
