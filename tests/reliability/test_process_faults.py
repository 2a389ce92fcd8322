"""Process faults in real 2-rank runs: SIGKILL of one rank or all in the middle of a step, SIGKILL of a
rank at each phase of a checkpoint write, a rank stalling while an async save is in flight. After each,
the same command is run again and must end exactly where an uninterrupted run ends."""

from __future__ import annotations

import pytest
from faultkit import RUN, assert_matches_reference, complete, exit_text, last_step, leftovers, run2, starts

pytestmark = pytest.mark.slow


def fault_then_rerun(tmp_path, ref, fault: str, extra: tuple[str, ...] = ()):
    """Run with the fault, then the same command again. Returns (first result, what the fault left:
    complete checkpoints and leftovers, last step logged before the fault, step the rerun resumed from)."""
    b = tmp_path / "b"
    first = run2(b, [*RUN, *extra], fault=fault)
    left = (complete(b), leftovers(b))
    before = last_step(b)
    second = run2(b, [*RUN, *extra])
    assert second.rc == 0, second.err[-3000:]
    resumed = starts(b)[-1]
    return first, left, before, resumed, assert_matches_reference(b, ref, resumed)


def test_sigkill_one_rank_mid_step(tmp_path, ref2, row):
    first, (done, _), before, resumed, same = fault_then_rerun(tmp_path, ref2, "kill@step:step=5:rank=1")
    assert first.rc not in (0, 85) and first.seconds < 90, (first.rc, first.seconds)
    assert done == [2, 4] and before == 4 and resumed == 4
    row(f"{exit_text(first.rc)} after {first.seconds:.0f} s; step_2, step_4 intact; {same}", before - resumed)


def test_sigkill_every_rank_mid_step(tmp_path, ref2, row):
    first, (done, _), before, resumed, same = fault_then_rerun(tmp_path, ref2, "kill@step:step=5")
    assert first.rc not in (0, 85)
    assert done == [2, 4] and before == 4 and resumed == 4
    row(f"{exit_text(first.rc)}; step_2, step_4 intact; {same}", before - resumed)


@pytest.mark.parametrize("point,rank", [
    ("save.shards_written", 0), ("save.shards_written", 1), ("save.marker_written", 0), ("save.marker_written", 1),
    ("save.async_in_flight", 0), ("save.async_in_flight", 1), ("save.pruning", 0)],
    ids=lambda v: f"rank{v}" if isinstance(v, int) else v)
def test_sigkill_during_save(tmp_path, ref2, row, point, rank):
    extra = {"save.async_in_flight": ("--async_checkpoint", "1"), "save.pruning": ("--keep_last_k", "1")}.get(point, ())
    first, (done, left), before, resumed, same = fault_then_rerun(tmp_path, ref2, f"kill@{point}:step=4:rank={rank}",
                                                                   extra)
    assert first.rc not in (0, 85), first.err[-2000:]
    assert before == 4
    if point == "save.pruning":  # step_4 was complete before step_2's deletion began
        assert done == [4] and left == ["step_2.old"] and resumed == 4
        assert not (tmp_path / "b" / "checkpoints" / "step_2.old").exists()  # the rerun's first save removed it
    elif point == "save.marker_written" and rank == 1:  # every file was on disk: rank 0 completes step_4 alone
        assert done == [2, 4] and not left and resumed == 4
    else:
        assert done == [2] and resumed == 2, (done, left)
        assert all(name == "step_4.tmp" for name in left), left  # never a step_4 that looks complete
    outcome = "step_4 complete" if 4 in done else f"step_4 not complete (left: {', '.join(left) or 'nothing'})"
    row(f"{exit_text(first.rc)}; {outcome}; {same}", before - resumed)


def test_slow_rank_during_async_save(tmp_path, ref2, row):
    b = tmp_path / "b"
    r = run2(b, [*RUN, "--async_checkpoint", "1"], fault="sleep@save.async_in_flight:step=4:rank=1:seconds=3",
             timeout=180)
    assert r.rc == 0, r.err[-3000:]
    assert complete(b) == [4, 6] and not leftovers(b)
    row(f"exit 0 in {r.seconds:.0f} s; {assert_matches_reference(b, ref2, 0)}", 0)
