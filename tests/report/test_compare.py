"""`llama_fp8 compare`: rates, the one speed-up, losses, verdict, plots, the log-line parser and input errors."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib.image import imread

from helpers import read_metrics, run_cli
from llama_fp8.report import compare as C
from llama_fp8.report.logparse import parse_log_line

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TAB_BLUE, TAB_ORANGE = (31, 119, 180), (255, 127, 14)   # the two runs' line colours


# --- fixtures: realistic run directories and logs --------------------------------------------------
def make_run(run_dir: Path, precision: str, *, steps: int = 40, speed: float = 50.0, loss_shift: float = 0.0,
             peak: float | None = None, val_every: int = 10, seed: int = 0, meta: bool = True) -> list[dict]:
    """Write metrics.jsonl (+ config.yaml) shaped like train.py's; returns the train records."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True)
    fp8 = precision.startswith("fp8")
    lines = []
    if meta:
        lines.append({"type": "meta", "precision": precision, "model": "tiny", "model_impl": "hf", "world_size": 2,
                      "device": "cuda" if peak else "cpu", "device_name": "H100" if peak else "cpu",
                      "peak_tflops_bf16": peak, "peak_tflops_fp8": 2 * peak if peak else None, "seq_len": 32,
                      "global_batch_size": 4, "flops_per_token": 5.5e6, "num_params": 1_400_000})
    train = []
    for step in range(1, steps + 1):
        sps = speed * (0.3 if step == 1 else rng.uniform(0.9, 1.1))   # step 1 pays for warm-up
        tflops = sps * 32 / 2 * 5.5e6 / 1e12
        rec = {"type": "train", "step": step, "loss": 8.0 * math.exp(-step / 30) + loss_shift + rng.gauss(0, 0.01),
               "lr": 1e-3, "grad_norm": 1.0, "samples_per_sec": sps, "samples_per_sec_per_device": sps / 2,
               "tokens_per_sec": sps * 32, "tokens_per_sec_per_device": sps * 16, "tflops_per_device": tflops,
               "mfu_vs_bf16_peak": tflops / peak if peak else None,
               "mfu_vs_fp8_peak": tflops / (2 * peak) if peak and fp8 else None,
               "mem_peak_gib": 0.4 + 0.01 * min(step, 5), "data_wait_frac": rng.uniform(0, 0.05),
               "elapsed_s": step * 0.1, "precision": precision, "world_size": 2, "time": 1.7e9 + step}
        train.append(rec)
        lines.append(rec)
        if val_every and step % val_every == 0:
            vl = 8.0 * math.exp(-step / 30) + loss_shift + 0.1
            lines.append({"type": "val", "step": step, "val_loss": vl, "val_ppl": math.exp(vl)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": "tiny", "fp8": fp8, "bf16": True,
                                                         "fp8_backend": "torchao", "fp8_recipe": "rowwise"}))
    return train


def log_line(rec: dict, extras: bool = True) -> str:
    """train.py's log line (or, without extras, the three-field line other recipes print)."""
    line = (f"Batch {rec['step']} Loss: {rec['loss']:.5f}, Speed: {rec['samples_per_sec']:.2f} samples/sec, "
            f"lr: {rec['lr']:.6f}")
    if extras:
        line += (f", tokens/s/device: {rec['tokens_per_sec_per_device']:.1f}, TFLOPS/device: "
                 f"{rec['tflops_per_device']:.3f}, MFU: n/a, mem: {rec['mem_peak_gib']:.2f} GiB, grad_norm: 1.000")
    return line


def run_compare(*args: str) -> tuple[int, dict, str]:
    """main() on the args; returns (exit code, summary.json, report.md) of --out (the last arg pair)."""
    rc = C.main(list(args))
    out = Path(args[list(args).index("--out") + 1])
    if rc != 0:
        return rc, {}, ""
    return rc, json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()


def table_row(report: str, label: str) -> list[str]:
    """Cells of the markdown table row whose first cell starts with ``label``."""
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0].startswith(label):
            return cells[1:]
    raise AssertionError(f"no row {label!r} in report:\n{report}")


def cell_value(cell: str) -> float:
    return float(cell.replace("%", "").replace("x", "").strip())


# --- the table equals the JSONL's rates; one speed-up ---------------------------------------------------
def rate(values) -> float:
    """A run's rate over its windows: work / time, the harmonic mean of the (equal-length) window rates."""
    values = list(values)
    return len(values) / sum(1 / v for v in values)


@pytest.mark.parametrize("warmup", [None, 7])
def test_table_numbers_are_rates_recomputed_from_jsonl_and_the_report_states_one_speed_up(tmp_path, warmup, capsys):
    a = make_run(tmp_path / "bf16run", "bf16", speed=40.0, peak=989.4, seed=1)
    b = make_run(tmp_path / "fp8run", "fp8-torchao-rowwise", speed=60.0, peak=989.4, seed=2)
    flags = [] if warmup is None else ["--warmup_steps_excluded", str(warmup)]
    rc, summary, report = run_compare(str(tmp_path / "bf16run"), str(tmp_path / "fp8run"),
                                      "--out", str(tmp_path / "out"), *flags)
    assert rc == 0
    excluded = 4 if warmup is None else warmup   # default: ceil(10 % of 40 steps) = 4
    for key, label, pct, reduce in [("samples_per_sec", "samples/s (global)", False, rate),
                                    ("tokens_per_sec_per_device", "tokens/s/device", False, rate),
                                    ("tflops_per_device", "TFLOPS/device", False, rate),
                                    ("mfu_vs_bf16_peak", "MFU vs BF16 peak", True, rate),
                                    ("data_wait_frac", "data-wait share", True, statistics.median)]:
        cells = table_row(report, label)
        for side, recs, cell in (("run_a", a, cells[0]), ("run_b", b, cells[1])):
            want = reduce([r[key] for r in recs if r["step"] > excluded])
            assert summary[side][key] == pytest.approx(want, rel=1e-12), (key, side)
            shown = cell_value(cell) / (100 if pct else 1)
            assert shown == pytest.approx(want, rel=5e-4, abs=5e-5 if pct else 0), (key, side, cell)
    # MFU vs the FP8 peak exists for the FP8 run only; the other side is n/a, never invented
    fp8_cells = table_row(report, "MFU vs FP8 peak")
    assert fp8_cells[0] == "n/a" and summary["run_a"]["mfu_vs_fp8_peak"] is None
    assert cell_value(fp8_cells[1]) / 100 == pytest.approx(
        rate(r["mfu_vs_fp8_peak"] for r in b if r["step"] > excluded), rel=5e-4)
    assert summary["run_b"]["mem_peak_gib"] == max(r["mem_peak_gib"] for r in b)
    # one speed-up: B's samples/s rate over A's, the table's own numbers, stated once as the headline
    speedup = summary["run_b"]["samples_per_sec"] / summary["run_a"]["samples_per_sec"]
    assert summary["speedup"] == pytest.approx(speedup, rel=1e-12) and 1.3 < speedup < 1.7
    assert summary["ab"]["speed"]["samples_per_sec"]["overall"]["ratio"] == pytest.approx(speedup, rel=1e-12)
    headline = [ln for ln in report.splitlines() if ln.startswith("**Speed-up")]
    assert headline == [f"**Speed-up B/A (samples/s): {summary['ab']['speed']['samples_per_sec']['text']}**"]
    assert f"{speedup:.3g}x, 95 % CI" in headline[0]
    # the summary line at the top states the same raw speed-up beside the iso-loss one and the verdict
    top = next(ln for ln in report.splitlines() if ln.startswith("**Headline:**"))
    assert f"raw speed-up {summary['ab']['speed']['samples_per_sec']['text']} | iso-loss speed-up " in top
    assert "| verdict PASS (train gap" in top and top.endswith(summary["headline"])
    assert "median samples/s" not in report and "| B/A |" not in report.split("## Loss")[0]  # no second ratio
    assert summary["run_a"]["label"] == "bf16" and summary["run_b"]["label"] == "fp8-torchao-rowwise"
    assert summary["run_a"]["warmup_steps_excluded"] == excluded
    out = capsys.readouterr().out
    assert f"report: {tmp_path / 'out' / 'report.md'}" in out and "throughput.png" in out
    assert f"speedup B/A: {summary['ab']['speed']['samples_per_sec']['text']}" in out


def test_cpu_run_shows_na_for_mfu(tmp_path):
    make_run(tmp_path / "a", "bf16", peak=None)
    make_run(tmp_path / "b", "fp8-torchao-tensorwise", peak=None)
    rc, summary, report = run_compare(str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o"))
    assert rc == 0
    assert table_row(report, "MFU vs BF16 peak") == ["n/a", "n/a"]
    assert summary["run_a"]["mfu_vs_bf16_peak"] is None and summary["run_b"]["mfu_vs_fp8_peak"] is None


def test_final_losses_and_gap(tmp_path):
    a = make_run(tmp_path / "a", "bf16", seed=3)
    b = make_run(tmp_path / "b", "fp8-te-delayed", loss_shift=0.05, seed=4)
    rc, summary, report = run_compare(str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o"))
    assert rc == 0
    k = C.final_loss_k(40)
    assert k == 5   # max(5, ceil(5 % of 40))
    la, lb = (statistics.fmean(r["loss"] for r in recs[-k:]) for recs in (a, b))
    loss = summary["loss"]
    assert loss["train_loss_a"] == pytest.approx(la) and loss["train_loss_b"] == pytest.approx(lb)
    assert loss["train_gap_pct"] == pytest.approx((lb - la) / la * 100)
    assert loss["val_step"] == 40 and loss["val_gap_pct"] == pytest.approx(
        0.05 / (8.0 * math.exp(-40 / 30) + 0.1) * 100)
    assert table_row(report, "final train loss")[2] == f"{loss['train_gap_pct']:+.3f} %"


# --- verdict ----------------------------------------------------------------------------------------
def test_verdict_flips_when_tolerance_is_tightened_below_the_gap(tmp_path):
    make_run(tmp_path / "a", "bf16", seed=5)
    make_run(tmp_path / "b", "fp8-torchao-rowwise", loss_shift=0.04, seed=6)
    args = [str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o")]
    rc, summary, report = run_compare(*args, "--loss_tolerance", "50")
    assert rc == 0 and summary["verdict"] == "PASS" and "**Verdict: PASS" in report
    gap = max(abs(summary["loss"]["train_gap_pct"]), abs(summary["loss"]["val_gap_pct"]))
    assert gap > 0.1
    rc, summary, report = run_compare(*args, "--loss_tolerance", str(gap * 1.01))
    assert rc == 0 and summary["verdict"] == "PASS"
    rc, summary, report = run_compare(*args, "--loss_tolerance", str(gap * 0.99))
    assert rc == 0 and summary["verdict"] == "FAIL" and "**Verdict: FAIL" in report and "exceeds" in report


def test_nan_loss_fails_the_verdict(tmp_path):
    make_run(tmp_path / "a", "bf16")
    b = tmp_path / "b.log"
    b.write_text("".join(f"Batch {s} Loss: nan, Speed: 10.00 samples/sec, lr: 0.000100\n" for s in range(1, 9)))
    rc, summary, _ = run_compare(str(tmp_path / "a"), str(b), "--out", str(tmp_path / "o"),
                                 "--loss_tolerance", "100")
    assert rc == 0 and summary["verdict"] == "FAIL" and "not finite" in summary["verdict_line"]


# --- plots --------------------------------------------------------------------------------------------
def colour_pixels(img: np.ndarray, rgb: tuple[int, int, int]) -> int:
    return int((np.abs(img[..., :3] * 255 - np.array(rgb)).max(axis=-1) < 30).sum())


def test_plots_are_valid_pngs_showing_both_runs(tmp_path):
    make_run(tmp_path / "a", "bf16", speed=40.0, seed=7)
    make_run(tmp_path / "b", "fp8-torchao-rowwise", speed=60.0, loss_shift=0.02, seed=8)
    rc, summary, report = run_compare(str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o"))
    assert rc == 0
    assert set(summary["plots"]) == {"throughput", "tflops", "train_loss", "val_loss"}
    for name, path in summary["plots"].items():
        path = Path(path)
        assert path.parent == tmp_path / "o" and f"]({path.name})" in report
        assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 10_000, name
        img = imread(path)
        assert img.ndim == 3 and img.shape[0] > 300 and img[..., :3].std() > 0.02, name   # not blank
        assert colour_pixels(img, TAB_BLUE) > 100 and colour_pixels(img, TAB_ORANGE) > 100, name


def test_no_tflops_no_val_means_no_such_plots(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.log").write_text("".join(
            f"Batch {s} Loss: {9 - s / 10:.5f}, Speed: 47.0{s} samples/sec, lr: 0.000100\n" for s in range(10)))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "tflops.png").write_bytes(b"stale")
    rc, summary, report = run_compare(str(tmp_path / "a.log"), str(tmp_path / "b.log"), "--out", str(tmp_path / "o"))
    assert rc == 0 and set(summary["plots"]) == {"throughput", "train_loss"}
    assert not (tmp_path / "o" / "tflops.png").exists()   # a stale plot would mislead
    assert table_row(report, "TFLOPS/device")[:2] == ["n/a", "n/a"]
    assert table_row(report, "final validation loss")[:2] == ["n/a", "n/a"]


# --- the log-line parser ------------------------------------------------------------------------------
@pytest.mark.parametrize("line, expected", [
    ("Batch 20 Loss: 8.42184, Speed: 47.06 samples/sec, lr: 0.000100",
     {"step": 20, "loss": 8.42184, "samples_per_sec": 47.06, "lr": 1e-4}),
    ("0: 2024-05-15 02:37:59 I [train.py:110] Batch 21 Loss: 8.26941, Speed: 47.30 samples/sec, lr: 0.000100",
     {"step": 21, "loss": 8.26941, "samples_per_sec": 47.30}),
    ("[default0]:2025-10-03 20:25:09,196 [INFO] __main__: Batch 1 Loss: 11.6533041, Speed: 0.56 samples/sec, "
     "lr: 0.000063", {"step": 1, "loss": 11.6533041, "samples_per_sec": 0.56}),
    ("3: Batch 7 Loss: 7.5, Speed: 10.0 samples/sec, lr: 0.000100, tokens/s/device: 1234.5, TFLOPS/device: 12.1, "
     "MFU: 0.41, mem: 30.2 GiB",
     {"step": 7, "tokens_per_sec_per_device": 1234.5, "tflops_per_device": 12.1, "mfu_vs_bf16_peak": 0.41,
      "mem_peak_gib": 30.2}),
    ("Batch 8 Loss: 7.4, Speed: 10.0 samples/sec, lr: 0.000100, tokens/s/device: 99.0, TFLOPS/device: n/a, "
     "MFU(fp8 peak): 0.250, mem: 512 MiB, grad_norm: 1.2",
     {"tflops_per_device": None, "mfu_vs_fp8_peak": 0.25, "mem_peak_gib": 0.5}),
    ("Batch 9 Loss: nan, Speed: 1e3 samples/sec, lr: 1e-05, MFU: 41%",
     {"step": 9, "samples_per_sec": 1000.0, "lr": 1e-5, "mfu_vs_bf16_peak": 0.41}),
    ("Validation loss at step 40: 7.12345, perplexity: 1237.1", {"type": "val", "step": 40, "val_loss": 7.12345}),
    ("0: 2024-05-15 I [train.py:120] Batch 500 Validation loss: 6.5", {"type": "val", "step": 500, "val_loss": 6.5}),
])
def test_log_line_parser(line, expected):
    expected = dict(expected)
    rec = parse_log_line(line)
    assert rec is not None
    assert rec["type"] == expected.pop("type", "train")
    for key, value in expected.items():
        assert rec[key] == pytest.approx(value) if value is not None else rec[key] is None, key
    if "Loss: nan" in line:
        assert math.isnan(rec["loss"])


@pytest.mark.parametrize("line", ["", "Training finished: 8 steps, run dir runs/1", "Batch 3 Loss: oops",
                                  "0: NCCL INFO Init COMPLETE", "Speed: 3 samples/sec"])
def test_log_parser_ignores_other_lines(line):
    assert parse_log_line(line) is None


def test_compare_reads_plain_slurm_logs(tmp_path):
    a = make_run(tmp_path / "ra", "bf16", seed=9)
    b = make_run(tmp_path / "rb", "fp8-torchao-rowwise", seed=10)
    noise = ["srun: job 42 queued", "0: NCCL INFO comm 0x1 rank 0 nranks 2 - Init COMPLETE"]
    (tmp_path / "bf16.out").write_text("\n".join(noise + [f"0: {log_line(r, extras=False)}" for r in a]) + "\n")
    (tmp_path / "fp8.out").write_text("\n".join(
        noise + ["0: 2026-01-01 INFO llama_fp8.train: model tiny (hf); precision fp8-torchao-rowwise"]
        + [f"0: 2026-01-01 12:00:00 I {log_line(r)}" for r in b]
        + ["0: Validation loss at step 40: 6.00000, perplexity: 403.4"]) + "\n")
    rc, summary, report = run_compare(str(tmp_path / "bf16.out"), str(tmp_path / "fp8.out"), "--out", str(tmp_path / "o"))
    assert rc == 0
    assert summary["run_a"]["label"] == "bf16" and summary["run_a"]["kind"] == "log"   # from the file name
    assert summary["run_b"]["label"] == "fp8-torchao-rowwise"   # from train.py's start-up line
    assert summary["run_a"]["samples_per_sec"] == pytest.approx(
        rate(round(r["samples_per_sec"], 2) for r in a if r["step"] > 4))
    assert summary["run_a"]["tokens_per_sec_per_device"] is None     # the three-field format has none
    assert summary["run_b"]["tokens_per_sec_per_device"] == pytest.approx(
        rate(round(r["tokens_per_sec_per_device"], 1) for r in b if r["step"] > 4))
    assert summary["loss"]["val_loss_b"] == 6.0 and summary["loss"]["val_loss_a"] is None


def test_requeued_run_keeps_the_last_record_per_step_and_skips_a_cut_line(tmp_path):
    make_run(tmp_path / "a", "bf16")
    make_run(tmp_path / "b", "bf16", meta=False)
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:   # resumed at step 30, then killed mid-line
        for step in range(31, 41):
            f.write(json.dumps({"type": "train", "step": step, "loss": 1.0, "samples_per_sec": 1.0}) + "\n")
        f.write('{"type": "train", "st')
    run = C.load_run(str(tmp_path / "b"), "RUN_B")
    assert [r["step"] for r in run.train] == list(range(1, 41))
    assert all(r["loss"] == 1.0 for r in run.train[30:])
    assert run.label == "bf16"   # no meta record: the train records' precision
    rc, summary, _ = run_compare(str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o"))
    assert rc == 0 and summary["run_a"]["label"] == "bf16 [a]" and summary["run_b"]["label"] == "bf16 [b]"


def test_label_from_config_yaml_and_default_out_dir(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    make_run(runs / "101", "bf16", meta=False)
    make_run(runs / "102", "fp8", meta=False)
    for name in ("101", "102"):   # no precision anywhere but config.yaml
        path = runs / name / "metrics.jsonl"
        recs = [json.loads(x) for x in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "precision"}) + "\n" for r in recs))
    monkeypatch.chdir(tmp_path)
    assert C.main(["runs/101", "runs/102/metrics.jsonl"]) == 0
    out = runs / "compare_101_vs_102"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run_a"]["label"] == "bf16" and summary["run_b"]["label"] == "fp8-torchao-rowwise"
    assert f"report: {out / 'report.md'}" in capsys.readouterr().out


# --- errors -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--bogus", "1"], "--bogus"),
    (["--loss", "2"], "--loss"),                      # no abbreviations: a typo must not pass silently
    (["--loss_tolerance", "-1"], "--loss_tolerance"),
    (["--loss_tolerance", "nan"], "--loss_tolerance"),
    (["--warmup_steps_excluded", "x"], "--warmup_steps_excluded"),
    (["--warmup_steps_excluded", "40"], "--warmup_steps_excluded 40 leaves no step of RUN_A"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, extra, message):
    make_run(tmp_path / "a", "bf16")
    make_run(tmp_path / "b", "fp8")
    assert C.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_bad_inputs_exit_2_naming_the_path(tmp_path, capsys):
    make_run(tmp_path / "good", "bf16")
    empty_log = tmp_path / "empty.log"
    empty_log.write_text("srun: error: node failure\nno batch lines here\n")
    (tmp_path / "nodir").mkdir()
    cases = [(tmp_path / "missing", "RUN_B path does not exist"), (empty_log, "RUN_B: no training records"),
             (tmp_path / "nodir", "without metrics.jsonl")]
    for bad, message in cases:
        assert C.main([str(tmp_path / "good"), str(bad), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert message in err and str(bad) in err, err
    assert C.main([str(tmp_path / "good")]) == 2   # RUN_B missing
    assert "RUN_B" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_dispatch_through_python_m(tmp_path):
    make_run(tmp_path / "a", "bf16")
    make_run(tmp_path / "b", "fp8-torchao-rowwise")
    proc = run_cli(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o")])
    assert proc.returncode == 0, proc.stderr
    assert f"report: {tmp_path / 'o' / 'report.md'}" in proc.stdout and "verdict: PASS" in proc.stdout
    assert "same training data: not checked" in proc.stdout  # these records carry no data_crc32
    proc = run_cli(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--nope"])
    assert proc.returncode == 2 and "--nope" in proc.stderr


# --- two real CPU runs ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_compare_two_real_cpu_runs(tmp_path):
    base = ["train", "--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
            "--train_batch_size", "2", "--max_steps", "8", "--validation_freq", "4", "--validation_batches", "2",
            "--val_batch_size", "1"]
    for fp8 in ("0", "1"):
        proc = run_cli([*base, "--fp8", fp8, "--run_dir", str(tmp_path / f"fp8_{fp8}")])
        assert proc.returncode == 0, proc.stderr[-2000:]
        (tmp_path / f"fp8_{fp8}.log").write_text(proc.stderr + proc.stdout)   # what a Slurm .out holds
    proc = run_cli(["compare", str(tmp_path / "fp8_0"), str(tmp_path / "fp8_1"), "--out", str(tmp_path / "rep")])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["run_a"]["label"] == "bf16" and summary["run_b"]["label"].startswith("fp8-torchao")
    assert summary["data"] == {"windows_compared": 8, "same": True, "first_different_step": None}
    assert "same training data: yes" in proc.stdout
    for side, name in (("run_a", "fp8_0"), ("run_b", "fp8_1")):
        recs = [r for r in read_metrics(tmp_path / name) if r["type"] == "train"]
        warm = summary[side]["warmup_steps_excluded"]
        assert warm == 1
        for key in ("samples_per_sec", "tokens_per_sec_per_device", "tflops_per_device"):
            assert summary[side][key] == pytest.approx(rate(r[key] for r in recs if r["step"] > warm), rel=1e-12)
        assert summary[side]["mfu_vs_bf16_peak"] is None   # CPU: no peak, no MFU
    for png in ("throughput", "tflops", "train_loss", "val_loss"):
        assert (tmp_path / "rep" / f"{png}.png").read_bytes()[:8] == PNG_SIGNATURE
    # the same runs read back from their plain logs agree with the JSONL to the printed precision
    rc, from_logs, _ = run_compare(str(tmp_path / "fp8_0.log"), str(tmp_path / "fp8_1.log"),
                                   "--out", str(tmp_path / "rep_logs"))
    assert rc == 0 and from_logs["run_b"]["label"] == summary["run_b"]["label"]
    assert from_logs["data"]["same"] is None  # plain logs carry no fingerprints
    assert from_logs["loss"]["train_loss_b"] == pytest.approx(summary["loss"]["train_loss_b"], abs=1e-5)
    assert from_logs["loss"]["val_loss_a"] == pytest.approx(summary["loss"]["val_loss_a"], abs=1e-5)
    assert from_logs["run_a"]["samples_per_sec"] == pytest.approx(summary["run_a"]["samples_per_sec"], abs=0.006), \
        (from_logs, summary, (tmp_path / "fp8_0.log").read_text())
