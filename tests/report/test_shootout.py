"""The recipe shoot-out: its arms on a CPU (cluster/launch/shootout.py), their schedule, and the call the ranking makes
from the arms' iso-loss intervals (report/shootout.py). The report of a real shoot-out of emulated arms:
tests/report/test_arms.py."""

from __future__ import annotations

import pytest
import torch

from llama_fp8.cluster.launch import schedule, shootout
from llama_fp8.report import shootout as ranking


def test_on_a_cpu_the_shootout_runs_bf16_and_the_emulated_torchao_recipes(capsys):
    arms = shootout.arms(["--model", "tiny"], torch.device("cpu"))
    assert [(a.name, a.fp8) for a in arms] == [("bf16", False), ("tensorwise", True), ("rowwise", True),
                                                 ("mxfp8", True)]
    assert arms[1].flags == ("--fp8_recipe=tensorwise", "--model_impl=hf")
    err = capsys.readouterr().err
    assert "current left out: --model_impl te runs Transformer Engine's CUDA kernels" in err
    assert "delayed left out" in err and "arms bf16, tensorwise, rowwise, mxfp8" in err


def test_the_shootout_schedule_interleaves_its_arms_with_their_flags(capsys):
    assert schedule.main(["--repeats", "2", "--arms", "shootout", "--order", "shootout", "--", "--model", "tiny",
                          "--device", "cpu", "--seed", "3"]) == 0
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines()]
    assert [ln[:3] for ln in lines] == [["pair1/bf16", "0", "3"], ["pair1/tensorwise", "1", "3"],
                                        ["pair1/rowwise", "1", "3"], ["pair1/mxfp8", "1", "3"],
                                        ["pair2/mxfp8", "1", "4"], ["pair2/rowwise", "1", "4"],
                                        ["pair2/tensorwise", "1", "4"], ["pair2/bf16", "0", "4"]]
    assert lines[2][3:] == ["--fp8_recipe=rowwise", "--model_impl=hf"] and lines[0][3:] == []
    assert schedule.main(["--repeats", "1", "--arms", "shootout", "--compare", "--", "--model", "tiny"]) == 0
    assert capsys.readouterr().out.split() == ["pair1/bf16", "pair1/tensorwise", "pair1/rowwise", "pair1/mxfp8"]


def test_bad_training_flags_are_refused_by_the_shootout(capsys):
    assert schedule.main(["--arms", "shootout", "--", "--model", "tiny", "--fp8_backend", "nope"]) == 2
    assert "error:" in capsys.readouterr().err


def entry(arm, point, low, high, baseline=False):
    return {"arm": arm, "label": arm, "baseline": baseline, "reached": point is not None, "point": point, "low": low,
            "high": high, "text": f"{point}x" if point else "not reached", "gap_pct": None if point else 0.3}


BASE = entry("bf16", 1.0, 1.0, 1.0, baseline=True)


@pytest.mark.parametrize("arms, winner, words", [
    ([entry("tensorwise", 1.25, 1.2, 1.3), entry("rowwise", 1.1, 1.05, 1.15)], "tensorwise",
     "tensorwise wins at equal quality (1.25x): its interval above every other arm's"),
    ([entry("tensorwise", 1.25, 1.12, 1.3), entry("rowwise", 1.1, 1.05, 1.15)], None,
     "cannot tell tensorwise (1.25x) from rowwise at equal quality"),
    ([entry("tensorwise", 1.05, 0.98, 1.1)], None, "cannot tell tensorwise (1.05x) from the baseline"),
    ([entry("tensorwise", 0.6, 0.55, 0.65), entry("mxfp8", 0.5, 0.45, 0.55)], "bf16",
     "the baseline wins at equal quality (1.0x): every candidate's interval below 1"),
    ([entry("tensorwise", None, None, None)], None, "no candidate reaches the baseline's final loss"),
])
def test_the_ranking_names_a_winner_only_when_its_interval_clears_every_other(arms, winner, words):
    got = ranking.rank([BASE, *arms])
    assert got["winner"] == winner and words in got["line"]
    reached = [e for e in got["order"] if e["reached"]]
    assert [e["point"] for e in reached] == sorted((e["point"] for e in reached), reverse=True)
    assert all(not e["reached"] for e in got["order"][len(reached):])  # not reached: last
