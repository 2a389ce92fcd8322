"""metrics.jsonl -> results record (the report's throughput without the warm-up, MFU, memory, losses), the speed-up
the results page states (the A/B report's), the results file (append, cut-off lines, done/retry, per GPU), and
the time box."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import runs
import steps


def write_metrics(run_dir: Path, losses: dict[int, float], *, start_step: int = 0, step_s: float = 0.5,
                  warm_s: float = 30.0, precision: str = "bf16", logging_freq: int = 1, append: bool = False) -> Path:
    """A metrics.jsonl as the trainer writes it: meta, then one train record per logged step; the first
    logged window also holds ``warm_s`` seconds of compile/warm-up."""
    run_dir.mkdir(parents=True, exist_ok=True)
    meta = {"type": "meta", "precision": precision, "model": "llama3.2-1b", "model_impl": "te", "world_size": 1,
            "device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "peak_tflops_bf16": 989.4,
            "peak_tflops_fp8": 1978.9, "seq_len": 4096, "global_batch_size": 2, "flops_per_token": 1.0e10,
            "num_params": 1_235_814_400, "fp8_emulated": False, "start_step": start_step}
    lines, previous = [meta], (start_step, 0.0)
    for step in sorted(losses):
        elapsed = warm_s + (step - start_step) * step_s
        samples, seconds = (step - previous[0]) * 2, elapsed - previous[1]
        tokens = samples * 4096 / seconds
        lines.append({"type": "train", "step": step, "loss": losses[step], "elapsed_s": elapsed,
                      "samples_per_sec": samples / seconds, "tokens_per_sec_per_device": tokens,
                      "tflops_per_device": tokens * 1e-2, "mfu_vs_bf16_peak": tokens * 1e-2 / 989.4,
                      "mfu_vs_fp8_peak": tokens * 1e-2 / 1978.9 if precision.startswith("fp8") else None,
                      "mem_peak_gib": 20.0 + step / 100, "mem_reserved_peak_gib": 24.0, "alloc_retries": 0,
                      "data_wait_frac": 0.01})
        previous = (step, elapsed)
    with open(run_dir / "metrics.jsonl", "a" if append else "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
    return run_dir


def test_throughput_is_the_reports_and_leaves_out_the_warmup(tmp_path):
    """One throughput definition: the record holds what ``python -m llama_fp8 compare`` reports for the run (its
    rate over the windows after the warm-up, work / time), not a second summary of its own."""
    from llama_fp8.report.compare import summarize_run
    from llama_fp8.report.runs import load_run

    run = write_metrics(tmp_path / "r", {s: 10.0 - s / 10 for s in range(5, 51, 5)}, precision="fp8-te-delayed")
    rec = steps.summarize(run, warmup=10)
    report = summarize_run(load_run(str(run / "metrics.jsonl"), "run"), 10)
    for key in steps.THROUGHPUT:
        assert rec[key] == report[key], key
    # the windows after step 10: 5 steps of 2 sequences of 4096 tokens in 2.5 s each; the first window (with
    # 30 s of warm-up) is left out
    tokens = 5 * 2 * 4096 / 2.5
    assert rec["warmup_steps"] == 10 and rec["timed_steps"] == 40
    assert rec["tokens_per_sec_per_device"] == pytest.approx(tokens)
    assert rec["samples_per_sec"] == pytest.approx(4.0)
    assert rec["tflops_per_device"] == pytest.approx(tokens * 1e10 / 1e12)
    assert rec["mfu_vs_bf16_peak"] == pytest.approx(tokens * 1e-2 / 989.4)
    assert rec["mfu_vs_fp8_peak"] == pytest.approx(tokens * 1e-2 / 1978.9)
    assert rec["mem_peak_gib"] == pytest.approx(20.5) and rec["mem_reserved_peak_gib"] == 24.0
    assert rec["losses"][0] == [5, 9.5] and (rec["last_step"], rec["last_loss"]) == (50, 5.0)
    assert rec["preset"] == "llama3.2-1b" and "model" not in rec
    assert rec["windows"] == [[s, pytest.approx(4.0)] for s in range(15, 51, 5)]  # the page's interval rests on them


def test_bf16_runs_have_no_fp8_mfu_and_a_run_without_timed_steps_has_no_rates(tmp_path):
    rec = steps.summarize(write_metrics(tmp_path / "a", {s: 1.0 for s in range(1, 21)}), warmup=5)
    assert rec["mfu_vs_fp8_peak"] is None and rec["timed_steps"] == 15
    rec = steps.summarize(write_metrics(tmp_path / "b", {1: 1.0, 2: 1.0}), warmup=5)
    assert rec["timed_steps"] == 0 and rec["tokens_per_sec_per_device"] is None


def test_a_run_dir_with_two_starts_is_read_as_the_report_reads_it(tmp_path):
    """One reader: a run dir that holds a restart gives one loss per step, the one written last (as
    ``python -m llama_fp8 compare`` reads it)."""
    run = write_metrics(tmp_path / "r", {1: 3.0, 2: 2.9, 3: 9.9})
    write_metrics(run, {3: 2.8, 4: 2.7}, start_step=2, append=True)
    assert {r["step"]: r["loss"] for r in steps.load(run).train} == {1: 3.0, 2: 2.9, 3: 2.8, 4: 2.7}
    with pytest.raises(steps.MetricsError, match="no metrics file"):
        steps.summarize(tmp_path / "missing", 0)


def test_the_results_pages_speed_up_is_the_ab_reports(tmp_path):
    """One speed-up: for the same two runs the results page's ratio is the headline of `llama_fp8 compare`."""
    import sections

    from llama_fp8.report import compare

    a = write_metrics(tmp_path / "bf16", {s: 3.0 for s in range(1, 41)}, step_s=0.5)
    b = write_metrics(tmp_path / "fp8", {s: 3.0 for s in range(1, 41)}, step_s=0.4, precision="fp8-te-current")
    for run, s in ((a, 0.5), (b, 0.4)):  # uneven windows: a median and a rate of them differ
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for r in recs[1:]:
            r["samples_per_sec"] = 2 / (s * (1.5 if r["step"] % 3 == 0 else 1.0))
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    ra, rb = steps.summarize(a, warmup=4), steps.summarize(b, warmup=4)
    summary = compare.compare(compare.build_parser().parse_args(
        [str(a), str(b), "--out", str(tmp_path / "rep"), "--warmup_steps_excluded", "4"]))
    assert sections.speedup(rb, ra) == pytest.approx(summary["speedup"], rel=1e-12)
    assert f"{summary['speedup']:.3g}x" in (tmp_path / "rep" / "report.md").read_text()


# --- results file ----------------------------------------------------------------------------------------
def test_results_file_appends_survives_a_cut_line_and_mirrors(tmp_path):
    store = runs.Store(tmp_path / "r" / "results.jsonl", mirror=tmp_path / "out")
    store.append({"key": "k", "unit": "a", "status": "passed"})
    with open(store.path, "a") as f:
        f.write('{"key": "k", "unit": "b", "sta')  # a writer killed mid-line
    store.append({"key": "k", "unit": "c", "status": "failed"})
    assert [r["unit"] for r in store.records()] == ["a", "c"]
    assert (tmp_path / "out" / "results.jsonl").read_text() == store.path.read_text()  # same name


def test_done_means_a_final_status_for_this_key(tmp_path):
    recs = [{"key": "k", "unit": "a", "status": "passed"}, {"key": "k", "unit": "b", "status": "interrupted"},
            {"key": "k", "unit": "c", "status": "failed"}, {"key": "other", "unit": "d", "status": "passed"},
            {"key": "k", "unit": "e", "status": "unavailable"}, {"key": "k", "unit": "f", "status": "refused"}]
    assert runs.done(recs, "k") == {"a", "c", "f"}
    assert runs.done(recs, "k", retry=True) == {"a", "f"}
    assert runs.done(recs + [{"key": "k", "unit": "c", "status": "passed"}], "k", retry=True) == {"a", "c", "f"}


# --- time box --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_timebox_kills_the_whole_group_at_the_limit(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = (f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\nprint('started', flush=True)\ntime.sleep(60)")
    t0 = time.monotonic()
    out = runs.timebox([sys.executable, "-c", code], 2.0, tmp_path / "log.txt")
    assert out.timed_out and out.returncode is None and time.monotonic() - t0 < 20
    assert "started" in out.tail() and "killed after 2 s" in out.tail()
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # reaped by init shortly after the kill
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {grandchild} survived the time box")


def test_timebox_returns_the_exit_code_and_the_budget_cuts_long_limits(tmp_path):
    out = runs.timebox([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"], 60, tmp_path / "log")
    assert (out.returncode, out.timed_out) == (3, False) and "hi" in out.tail()
    now = [100.0]
    budget = runs.Budget(50, clock=lambda: now[0])
    assert budget.limit(480) == (50, True) and budget.limit(30) == (30, False)
    now[0] = 140.0
    assert budget.left() == 10 and runs.Budget(None).limit(480) == (480, False)


def test_the_record_holds_the_runs_fp8_check(tmp_path):
    """The FP8 check the trainer writes after its first steps (coverage, the profiled step's GEMM kernels, problems)
    goes into the record as written; a BF16 run has none."""
    run = write_metrics(tmp_path / "fp8", {s: 3.0 for s in range(1, 11)}, precision="fp8-te-current")
    check = {"type": "fp8_check", "step": 2, "fp8_linears": 112, "linears": 113, "fp8_flop_share": 0.91,
             "gemm_kernel_names": 9, "fp8_gemm_kernels": 6, "problems": [], "notes": []}
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(check) + "\n")
    rec = steps.summarize(run, warmup=2)
    assert rec["fp8_check"] == {k: v for k, v in check.items() if k != "type"}
    assert steps.summarize(write_metrics(tmp_path / "bf16", {1: 3.0, 2: 2.9}), warmup=0)["fp8_check"] is None
