"""Smoke tests of the CPU benchmarks: each runs end to end on a tiny setting, prints its table and one
JSON line with the ratio. Speed and memory are measured by the benchmarks, never asserted here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import REPO, cli_env

pytestmark = pytest.mark.slow


def run_bench(name: str, *args: str) -> tuple[str, dict]:
    """Run benchmarks/<name> in a fresh process; return its stdout and its one JSON line. The benchmark leaves no
    folder of its own in the temporary folder (its runs' folders go with it: `make bench` gathered them in /tmp)."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, str(REPO / "benchmarks" / name), *args], capture_output=True, text=True,
                           timeout=600, env=cli_env(TMPDIR=tmp), cwd=REPO)
        left = sorted(p.name for p in Path(tmp).glob("llama-fp8-*"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not left, left
    json_lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert len(json_lines) == 1, r.stdout
    rec = json.loads(json_lines[0])
    assert isinstance(rec["ratio"], float) and math.isfinite(rec["ratio"]) and rec["ratio"] > 0, rec
    return r.stdout, rec


def table_rows(stdout: str, first_word: str) -> list[list[str]]:
    return [ln.split() for ln in stdout.splitlines() if ln.split()[:1] == [first_word]]


def test_bench_loop_prints_table_and_ratio():
    out, rec = run_bench("bench_loop.py", "--seq_len", "32", "--batch_size", "1", "--num_layers", "2",
                         "--steps", "1", "--rounds", "2", "--warmup", "1")
    assert "median s/step" in out
    assert len(table_rows(out, "ours")) == 1 and len(table_rows(out, "bare")) == 1, out
    assert rec["bench"] == "loop" and rec["world_size"] == 2 and rec["num_layers"] == 2
    assert rec["ours_median_s"] > 0 and rec["bare_median_s"] > 0
    # Same weights, same batch: both loops compute the same first loss (otherwise the timing compares
    # two different computations).
    assert rec["first_loss_ours"] == pytest.approx(rec["first_loss_bare"], rel=1e-3), rec


def test_bench_init_memory_prints_table_and_ratio():
    out, rec = run_bench("bench_init_memory.py", "--model", "tiny")
    assert "peak RSS MiB" in out
    assert len(table_rows(out, "ours")) == 2 and len(table_rows(out, "baseline")) == 2, out
    assert rec["bench"] == "init_memory" and rec["model"] == "tiny" and rec["world_size"] == 2
    assert rec["ours_peak_rss_mib"] > 0 and rec["baseline_peak_rss_mib"] > 0
    # Both variants end with the same sharded model: half of the parameters on each rank.
    assert rec["local_params"]["ours"] == rec["local_params"]["baseline"] == rec["num_params"] // 2, rec


def test_bench_activation_memory_prints_table_and_ratio():
    out, rec = run_bench("bench_activation_memory.py", "--seq_len", "32", "--batch_size", "1", "--num_layers", "1",
                         "--steps", "1")
    assert rec["bench"] == "activation_memory" and set(rec["results"]) == {"none", "selective", "full"}
    # Recomputation does not change the numbers: the same loss in every mode.
    assert len({r["loss"] for r in rec["results"].values()}) == 1
    assert "activation_checkpointing" in out


def test_bench_data_prints_table_and_ratio(tmp_path):
    out, rec = run_bench("bench_data.py", "--work_dir", str(tmp_path), "--seq_len", "64", "--batch_size", "2",
                         "--num_workers", "2", "--seconds", "0.2", "--warmup", "0.1", "--rounds", "3",
                         "--memory_tokens", "100000", "--memory_batches", "10")
    table = [row[0] for row in table_rows(out, "baseline") + table_rows(out, "pipeline") + table_rows(out, "corpus")
             if row[-1].endswith("s") and row[-3].endswith("x")]  # the table's rows: "... 1.00x 2.81 0.21s"
    assert table == ["baseline", "pipeline", "pipeline", "pipeline", "corpus", "corpus"], out
    assert rec["bench"] == "data" and rec["num_workers"] == 2 and rec["rounds"] == 3
    # Apples to apples: the batched encoder yields the baseline's token stream exactly.
    assert rec["same_tokens"] is True, rec
    assert len(rec["ratio_rounds"]) == 3 and rec["ratio"] == sorted(rec["ratio_rounds"])[1], rec
    assert len(rec["corpus_ratio_rounds"]) == 3 and rec["corpus_ratio"] == sorted(rec["corpus_ratio_rounds"])[1], rec
    assert len(rec["tokens_per_s"]) == 6 and all(v > 0 for v in rec["tokens_per_s"].values()), rec
    assert rec["pipeline_tokens_per_s"] == rec["tokens_per_s"]["pipeline 2 workers"]
    assert rec["corpus_tokens_per_s"] == rec["tokens_per_s"]["corpus in-process"]
    assert rec["tokenize"]["tokens"] > 0 and rec["tokenize"]["cached"] is False
    small, large = rec["memory"]["1x"], rec["memory"]["10x"]
    assert large["tokens"] >= 10 * small["tokens"] and large["batches"] == small["batches"] == 10, rec["memory"]


def test_bench_checkpoint_prints_table_and_ratio(tmp_path):
    out, rec = run_bench("bench_checkpoint.py", "--hidden_width", "64", "--num_layers", "1", "--vocab_size", "512",
                         "--intermediate_size", "128", "--rounds", "2", "--dir", str(tmp_path))
    rows = [ln.split()[0] + " " + ln.split()[1] for ln in out.splitlines() if ln.startswith(("raw ", "ours ", "async "))]
    assert rows == ["raw write", "ours save", "async blocked", "async total", "raw read", "ours load", "ours load",
                    "ours verify"], out
    assert rec["bench"] == "checkpoint" and rec["world_size"] == 2 and rec["rounds"] == 2
    # What is timed is the real state: FP32 weights + two AdamW moments (+ a step counter per tensor) = 12 bytes
    # per parameter, summed over both ranks' shards.
    assert rec["state_bytes"] >= 12 * 60_000, rec
    assert all(v > 0 for v in rec["gbps"].values()) and rec["ratio"] == min(rec["save_ratio"], rec["load_ratio"])
    assert rec["async_blocked_ratio"] > 0 and rec["verify_cost_ratio"] > 0
    # median and spread of the repeats; where a sync save's time goes, as shares of it
    lo, hi = rec["spread_s"]["ours save (sync)"]
    assert lo <= rec["median_s"]["ours save (sync)"] <= hi, rec
    parts = {k: v for k, v in rec["save_share"].items() if k != "other"}
    assert set(parts) == {"per-rank file", "DCP serialization", "fsync", "checksum pass"}, rec
    assert all(v > 0 for v in parts.values()) and sum(parts.values()) < 1.0, rec
    assert 0 <= rec["save_share"]["other"] < 1.0, rec  # the rest of the save, per round (not 1 - the medians)
    # --dir names the file system: each run makes its own folder there (a second run must not find the
    # first one's run folder, which training refuses to reuse) and removes it
    assert f"files in {tmp_path}/bench_checkpoint-" in out and not any(tmp_path.iterdir()), out


def test_bench_fp8_stats_prints_table_and_ratios():
    out, rec = run_bench("bench_fp8_stats.py", "--seq_len", "16", "--batch_size", "1", "--num_layers", "1",
                         "--window", "2", "--rounds", "1")
    assert [row[0] for row in table_rows(out, "off") + table_rows(out, "N=50") + table_rows(out, "N=1")] == \
        ["off", "N=50", "N=1"]
    assert rec["bench"] == "fp8_stats" and rec["ratio"] == rec["ratio_n50"] and rec["ratio_n1"] > 0
    # one statistics pass per N steps: the N=50 ratio is the N=1 pass cost spread over 50 steps
    # (the JSON rounds seconds to 5 decimals: a few-millisecond step's ratio is known to about 1e-3)
    assert rec["ratio_n1"] - 1 == pytest.approx(rec["stats_pass_s"] / rec["plain_step_s"], rel=1e-2, abs=2e-3)
    assert rec["ratio_n50"] - 1 == pytest.approx((rec["ratio_n1"] - 1) / 50, abs=2e-4)
    assert rec["window_ratio_n50"] > 0 and rec["window_ratio_n1"] > 0


def test_bench_memory_prints_table_and_ratio():
    out, rec = run_bench("bench_memory.py", "--presets", "tiny:1", "--modes", "none,selective")
    assert [r[2] for r in table_rows(out, "tiny")] == ["none", "selective"], out
    assert rec["bench"] == "memory" and [r["mode"] for r in rec["rows"]] == ["none", "selective"]
    assert rec["ratio"] == round(rec["rows"][1]["tracked_gib"] / rec["rows"][0]["tracked_gib"], 4)
    out, rec = run_bench("bench_memory.py", "--presets", "tiny:1", "--keeps", "q,k,v,o,gate,up,down;q")
    assert [r["keeps"] for r in rec["rows"]] == [["q", "k", "v", "o", "gate", "up", "down"], ["q"]], rec


def test_bench_loss_prints_table_and_ratio():
    out, rec = run_bench("bench_loss.py", "--tokens", "512", "--hidden", "32", "--vocab", "4096", "--steps", "1")
    assert [r[0] for r in table_rows(out, "whole") + table_rows(out, "compiled") + table_rows(out, "chunked")] == [
        "whole", "compiled", "chunked"], out
    # the same loss three ways (the chunked one's first chunk is all 512 rows: one chunk, the same numbers)
    assert all(r["loss_diff"] < 1e-5 for r in rec["rows"].values()), rec
    assert rec["ratio"] == round(rec["rows"]["chunked"]["peak_rss_growth_mib"] /
                                 rec["rows"]["whole"]["peak_rss_growth_mib"], 4), rec


def test_bench_exit_prints_table_and_ratio():
    out, rec = run_bench("bench_exit.py", "--rounds", "1", "--steps", "1", "--num_layers", "1")
    assert [r[0] for r in table_rows(out, "leave") + table_rows(out, "plain")] == ["leave", "plain"], out
    assert rec["bench"] == "exit" and rec["rounds"] == 1 and set(rec["median"]) == {"leave", "plain"}
    # the same run both ways (the same loss): only how the process leaves differs
    assert rec["losses"]["leave"] == rec["losses"]["plain"] and len(rec["losses"]["leave"]) == 1, rec
    med = rec["median"]
    assert all(0 < m["exit_s"] < m["wall_s"] and m["cpu_s"] > 0 for m in med.values()), med
    assert rec["ratio"] == pytest.approx(med["leave"]["exit_s"] / med["plain"]["exit_s"], abs=2e-3), rec
