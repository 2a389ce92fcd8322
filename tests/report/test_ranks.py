"""The report's stragglers and throttling: repeat offenders, the rank x window strip's values, and
"speed not comparable" when the arms differ in throttling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llama_fp8.report import compare as C
from llama_fp8.report import ranks
from llama_fp8.report.runs import load_run

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, precision: str, *, throttle_every: int = 0, slow_rank: int | None = None,
              health: str = "measured") -> None:
    run_dir.mkdir(parents=True)
    recs = [{"type": "meta", "precision": precision, "world_size": 4}]
    for w, step in enumerate(range(5, 45, 5)):
        rs = []
        for r in range(4):
            thr = bool(throttle_every) and w % throttle_every == 0 and r >= 2
            rs.append({"rank": r, "host": f"n{r // 2}", "local_rank": r % 2,
                       "step_s": 1.0 + (0.5 if r == slow_rank and w % 2 == 0 else 0.0), "data_wait_s": 0.0,
                       "throttle_thermal": float(thr), "throttle_power": 0.0})
        named = [{"rank": slow_rank, "host": f"n{slow_rank // 2}", "local_rank": slow_rank % 2, "slower_pct": 50.0,
                  "cause": "step time"}] if slow_rank is not None and w % 2 == 0 else []
        thr_nodes = {"n1": {"throttle_thermal": True, "throttle_power": False}} if throttle_every and w % throttle_every == 0 else {}
        recs.append({"type": "train", "step": step, "loss": 5.0 - 0.01 * step, "samples_per_sec": 10.0,
                     "ranks": rs, "stragglers": named, "gpu_health": health, "gpu_nodes": thr_nodes,
                     "throttled": bool(thr_nodes)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_throttling_in_one_arm_makes_speed_not_comparable_and_offenders_are_named(tmp_path):
    write_run(tmp_path / "bf16", "bf16")
    write_run(tmp_path / "fp8", "fp8", throttle_every=2, slow_rank=3)
    assert C.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "o")]) == 0
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    v = s["ranks"]
    assert v["b"]["throttled_windows"] == 4 and v["b"]["gpu_measured_windows"] == 8 and v["a"]["throttled_windows"] == 0
    assert v["comparable"] is False and "speed not comparable: throttled windows A 0 % vs B 50 %" in s["verdict_line"]
    assert s["verdict"] == "PASS"   # the loss verdict stands
    assert v["b"]["repeat_offenders"] == ["rank 3 (n1 GPU 1)"] and v["a"]["repeat_offenders"] == []
    assert v["b"]["throttled_nodes"] == ["n1"]
    report = (tmp_path / "o" / "report.md").read_text()
    assert "| GPU throttled windows | 0 of 8 | 4 of 8 on n1 |" in report and "![rank x window](ranks.png)" in report
    assert (tmp_path / "o" / "ranks.png").read_bytes().startswith(PNG)


def test_strip_values_are_percent_over_the_median_rank(tmp_path):
    write_run(tmp_path / "r", "fp8", slow_rank=3)
    steps, rows = ranks.slowness(load_run(str(tmp_path / "r"), "RUN_A"))
    assert steps == list(range(5, 45, 5)) and len(rows) == 4
    # window 0: totals 1, 1, 1, 1.5 -> median 1.0; rank 3 is 50 % slower; window 1: all equal
    assert rows[3][0] == pytest.approx(50.0) and rows[3][1] == 0.0 and rows[0][0] == 0.0


def test_not_measured_throttling_says_so(tmp_path):
    write_run(tmp_path / "bf16", "bf16", health="not measured (no CUDA device)")
    write_run(tmp_path / "fp8", "fp8", health="not measured (no CUDA device)")
    assert C.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "o")]) == 0
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["ranks"]["comparable"] is None and "not comparable" not in s["verdict_line"]
    assert "Throttling: throttling not measured (no CUDA device)" in (tmp_path / "o" / "report.md").read_text()


def test_alike_throttling_stays_comparable(tmp_path):
    write_run(tmp_path / "bf16", "bf16", throttle_every=2)
    write_run(tmp_path / "fp8", "fp8", throttle_every=2)
    assert C.main([str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "o")]) == 0
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["ranks"]["comparable"] is True and "not comparable" not in s["verdict_line"]
