"""A training run's ``metrics.jsonl`` -> the numbers a results record keeps.

The trainer writes (src/llama_fp8/metrics.py, train/state.py): one ``meta`` record at start (precision,
model_impl, device_name, peak_tflops_bf16/fp8, seq_len, global_batch_size, flops_per_token, num_params,
world_size, fp8_emulated, start_step), then one ``train`` record per logging step: the window since the
previous one (loss = mean over the window, tokens/s, mem_peak_gib = high-water mark so far, elapsed_s =
seconds since the meter started, after the device synchronized).

Throughput, TFLOPS and MFU are the report's (``llama_fp8.report.compare.summarize_run``, what ``python -m
llama_fp8 compare`` prints): the median of the per-window rates over logged steps after ``warmup``, so a
results page and an A/B report of the same run give the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsError(ValueError):
    pass


def read(path: Path) -> list[dict]:
    if not path.is_file():
        raise MetricsError(f"{path}: no metrics file (the run wrote none)")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut off by a kill
    return out


def last_run(records: list[dict]) -> tuple[dict, list[dict], list[dict]]:
    """(meta, train records, val records) of the last start in the file (a run dir reused by a resume
    holds several)."""
    starts = [i for i, r in enumerate(records) if r.get("type") == "meta"]
    if not starts:
        raise MetricsError("no meta record: not a metrics.jsonl of llama_fp8 train")
    rest = records[starts[-1]:]
    return rest[0], [r for r in rest if r.get("type") == "train"], [r for r in rest if r.get("type") == "val"]


THROUGHPUT = ("samples_per_sec", "tokens_per_sec_per_device", "tflops_per_device", "mfu_vs_bf16_peak",
              "mfu_vs_fp8_peak")


def timing(run_dir: Path, meta: dict, train: list[dict], warmup: int) -> dict:
    """The report's throughput over the logged steps after ``warmup`` (counted from the run's start step)."""
    from llama_fp8.report.compare import summarize_run
    from llama_fp8.report.runs import CompareError, load_run

    if not train:
        raise MetricsError("no train records")
    start = meta.get("start_step") or 0
    timed = [r for r in train if r["step"] > start + warmup]
    out = {"warmup_steps": warmup, "timed_steps": (timed[-1]["step"] - start - warmup) if timed else 0}
    if not timed:
        return {**out, **dict.fromkeys(THROUGHPUT)}
    try:
        summary = summarize_run(load_run(str(run_dir / "metrics.jsonl"), "run"), start + warmup)
    except CompareError as e:
        raise MetricsError(str(e)) from None
    return {**out, **{k: summary.get(k) for k in THROUGHPUT}}


META_KEEP = ("precision", "model_impl", "device_name", "peak_tflops_bf16", "peak_tflops_fp8", "seq_len",
             "global_batch_size", "flops_per_token", "num_params", "world_size", "fp8_emulated", "start_step")


def summarize(run_dir: Path, warmup: int) -> dict:
    """The record fields of one finished run: meta, timing, memory, losses per logged step."""
    meta, train, val = last_run(read(run_dir / "metrics.jsonl"))
    out = {k: meta.get(k) for k in META_KEEP}
    out["preset"] = meta.get("model")  # not "model": records name the matrix model (llama2-7b-8l), not the preset
    out.update(timing(run_dir, meta, train, warmup))
    mem = [r.get("mem_peak_gib") for r in train if r.get("mem_peak_gib") is not None]
    reserved = [r.get("mem_reserved_peak_gib") for r in train if r.get("mem_reserved_peak_gib") is not None]
    timed = [r for r in train if r["step"] > warmup + (meta.get("start_step") or 0)]
    out.update(
        mem_peak_gib=max(mem) if mem else None,
        mem_reserved_peak_gib=max(reserved) if reserved else None,
        alloc_retries=max((r.get("alloc_retries", 0) for r in train), default=0),
        data_wait_frac=max((r.get("data_wait_frac", 0.0) for r in timed), default=None),
        losses=[[r["step"], r["loss"]] for r in train],
        last_step=train[-1]["step"] if train else None,
        last_loss=train[-1]["loss"] if train else None,
        val_losses=[[r["step"], r["val_loss"]] for r in val],
    )
    return out


def losses_by_step(run_dir: Path) -> dict[int, float]:
    _, train, _ = last_run(read(run_dir / "metrics.jsonl"))
    return {r["step"]: r["loss"] for r in train}


def max_gap(a: dict[int, float], b: dict[int, float], steps: range) -> tuple[float, float] | None:
    """(max |a-b|, max |a-b|/|b|) over ``steps``; None if a step is missing in either."""
    if any(s not in a or s not in b for s in steps):
        return None
    diffs = [(abs(a[s] - b[s]), abs(a[s] - b[s]) / max(abs(b[s]), 1e-12)) for s in steps]
    return max(d for d, _ in diffs), max(r for _, r in diffs)


RESUME_NOISE_FACTOR, RESUME_REL_FLOOR = 2.0, 1e-3


def compare_resume(u1: Path, u2: Path, p1: Path, p2: Path, k: int) -> dict:
    """Save at step k and resume to 2k (p1 then p2) against two uninterrupted runs (u1, u2).

    noise = the largest relative difference between the two uninterrupted runs over steps k+1..2k; gap = the
    largest relative difference between the resumed run and u1 there. passed: the resumed run started at step
    k and gap <= max(2 * noise, 1e-3), the criterion of the GPU test
    tests/models/te/test_te_gpu.py::test_te_fp8_resume_matches_the_uninterrupted_run, so that both give one
    answer to one question."""
    a, b, first, resumed = (losses_by_step(d) for d in (u1, u2, p1, p2))
    second_half = range(k + 1, 2 * k + 1)
    start = last_run(read(p2 / "metrics.jsonl"))[0].get("start_step")
    noise, gap = max_gap(b, a, second_half), max_gap(resumed, a, second_half)
    before = max_gap(first, a, range(1, k + 1))
    out = {"k": k, "resumed_from_step": start, "noise_abs": noise and noise[0], "noise_rel": noise and noise[1],
           "gap_abs": gap and gap[0], "gap_rel": gap and gap[1], "gap_before_save_abs": before and before[0],
           "losses": {name: sorted(d.items()) for name, d in
                      (("uninterrupted", a), ("uninterrupted_again", b), ("until_save", first), ("resumed", resumed))}}
    if start != k:
        return {**out, "status": "failed", "reason": f"the resumed run started at step {start}, not {k}"}
    if noise is None or gap is None:
        return {**out, "status": "failed", "reason": "a run lacks logged losses for steps k+1..2k"}
    allowed = max(RESUME_NOISE_FACTOR * noise[1], RESUME_REL_FLOOR)
    if gap[0] == 0:
        return {**out, "status": "passed", "reason": "exact"}
    if gap[1] <= allowed:
        return {**out, "status": "passed", "reason": f"relative gap {gap[1]:.2g} <= max(2 x noise, 1e-3) = {allowed:.2g}"}
    return {**out, "status": "failed", "reason": f"relative gap {gap[1]:.2g} > max(2 x noise, 1e-3) = {allowed:.2g}"}
