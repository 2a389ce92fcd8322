"""The estimate's GPU terms and margin against published peaks (tests/estimate/published.py: torchtitan's H100
tables, estimated for the program that produced them as far as this repository can build it).

The band: the estimate with its margin (tracked peak + the GPU terms + 20 %) at or above each published reserved peak,
so that "fits" is not said of a configuration that ran out of memory, and at most 15 % above it, so that the margin
does not turn what runs into "does not fit". Measured (December 2024 runs, eager estimates): 1.02 to 1.07. The
estimator before the terms were set from the published measurements (an H100 of nvidia-smi's 81,559 MiB, 640 MiB of
NCCL buffers without NVLS, a 5 % margin) gave 0.90 to 0.94 of the same peaks: below the band.

In-sample: the 20 % margin (terms.ALLOCATOR_MARGIN) was set from these same four rows (ROWS). Any margin from 17.3 %
to 29.2 % of the tracked peak puts all four in the band (IN_SAMPLE_MARGINS, derived from one estimate per row:
test_the_margins_that_pass_in_sample_are_the_documented_ones), so for these rows this test guards against the terms
drifting; it does not validate the margin. docs/estimate.md says so.

Held out (HELD_OUT): the same tables' compiled runs, which the margin was not set from. The estimate is eager and
compiled blocks needed less (5.4 and 5.0 GiB in Tables 1 and 3), so only the band's lower edge is theirs to check:
"fits" is never said of what needed more. Measured: 1.09 and 1.10 (Table 1, BF16 and Float8), 1.16 and 1.16 (Table 3,
above the band's top: the compile savings are not estimated); a margin of 9.4 % or more keeps all four at or above
1.0, so they bound the margin from below only weakly. The old terms gave 0.96, 0.96, 1.01 and 1.02: this test catches
them on Table 1's rows only.
"""

from __future__ import annotations

import math

import pytest
from published import HELD_OUT, ROWS, estimate, passing_margins, ratio, torchtitan_like

from llama_fp8.estimate import terms

pytestmark = pytest.mark.slow

LOW, HIGH = 1.0, 1.15
IN_SAMPLE_MARGINS = (0.173, 0.292)  # docs/estimate.md: "from 17.3 % to 29.2 %"; rounded inwards to 0.1 %

_ESTIMATES: dict = {}


def estimated(row):
    """One estimate per program, shared by the tests of this module: ``--compile 1`` is estimated eager (estimate/
    build.py runs the step with ``compile`` off and adds no term for it), so a compiled row shares its eager twin's."""
    flags = list(row.flags)
    if "--compile" in flags:
        del flags[flags.index("--compile"):flags.index("--compile") + 2]
    key = (tuple(flags), row.nodes)
    if key not in _ESTIMATES:
        with torchtitan_like():
            _ESTIMATES[key] = estimate(row)
    return _ESTIMATES[key]


def old_ratio(e, row) -> float:
    """The terms and margin before they were set from the published rows, on the same tracked peak."""
    m = e.measurement
    comms = terms.communicators(m.collectives, m.group_ranks)
    old_needed = m.peak_bytes + 2**30 + 640 * 2**20 * len(comms) + 32 * 2**20 + m.fp8_operand_bytes
    return (old_needed + 0.05 * m.peak_bytes) / (row.reserved_gib * 2**30)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_the_estimate_with_its_margin_is_in_the_published_peaks_band(row):
    e = estimated(row)
    got = ratio(e, row)
    needed = e.verdict.needed / 2**30
    assert LOW <= got <= HIGH, f"{row.name}: needed {needed:.2f} GiB + margin, {got:.3f} x the published {row.reserved_gib}"
    # the old terms and margin on the same tracked peak: below the published peak, which the band catches
    old = old_ratio(e, row)
    assert old < LOW, f"{row.name}: the old terms gave {old:.3f}"


def test_the_margins_that_pass_in_sample_are_the_documented_ones():
    """The range of margins that put every in-sample row in the band, from one estimate per row (the margin moves
    only the ratio: low <= (needed + m x tracked) / published <= high, solved for m), is the one the docs quote."""
    ranges = [passing_margins(estimated(row), row, LOW, HIGH) for row in ROWS]
    least, most = max(r[0] for r in ranges), min(r[1] for r in ranges)
    assert least <= terms.ALLOCATOR_MARGIN <= most, ranges
    assert (math.ceil(least * 1000) / 1000, math.floor(most * 1000) / 1000) == IN_SAMPLE_MARGINS, (least, most)


@pytest.mark.parametrize("row", HELD_OUT, ids=[r.name for r in HELD_OUT])
def test_held_out_published_rows_never_get_a_fits_below_their_peak(row):
    e = estimated(row)
    got = ratio(e, row)
    least = passing_margins(e, row, LOW, math.inf)[0]
    assert got >= LOW, (f"{row.name}: {got:.3f} x the published {row.reserved_gib} (held out, compiled, estimated "
                        f"eager); it needs a margin of {least:.1%}")
