"""docs/gpu-results.md is what scripts/gpu/results.py makes of the committed results, and the generator's
tables hold the right ratios, gaps and outcomes for a made-up visit (numbers chosen so each is easy to check)."""

from __future__ import annotations

import json

import kit
import results
import units

KEY = "sm90-0123456789"
H100 = "NVIDIA H100 80GB HBM3"
VERSIONS = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580.159.04", "capability": "9.0", "torch": "2.11.0+cu130",
            "transformer_engine": "2.20.2", "torchao": "0.18.0"}


def cell(model, variant, tokens, loss=5.0, status="passed", **extra):
    v = units.VARIANT[variant]
    rec = {"key": KEY, "gpu": H100, "unit": f"train/{model}/synthetic/{variant}", "kind": "train", "status": status,
           "model": model, "data": "synthetic", **v.fields(), "date": "2026-12-01T10:00:00+00:00"}
    if status == "passed":
        rec.update(tokens_per_sec_per_device=tokens, samples_per_sec=tokens / 8192, tflops_per_device=tokens * 2e-2,
                   mfu_vs_bf16_peak=tokens * 2e-2 / 989.4, mem_peak_gib=40.0, last_loss=loss, last_step=100,
                   num_params=3.2e9, seq_len=4096, global_batch_size=2, timed_steps=90, warmup_steps=10)
    return {**rec, **extra}


def visit() -> list[dict]:
    m, recs = "llama3.2-3b", [{"key": KEY, "gpu": H100, "unit": "versions", "kind": "versions", "status": "passed",
                               "versions": VERSIONS, "src_sha": "abc", "git": "d2", "date": "2026-12-01T09:00:00+00:00"}]
    resume = "tests/models/te/test_te_gpu.py::test_te_fp8_resume_matches_the_uninterrupted_run"
    recs += [{"key": KEY, "gpu": H100, "unit": f"test:{n}", "kind": "test", "nodeid": n, "status": s, "message": msg}
             for n, s, msg in (("tests/a.py::test_ok", "passed", ""), ("tests/a.py::test_bad", "failed", "E  wrong\n"),
                               ("tests/a.py::test_mx", "skipped", "Skipped: Blackwell only"),
                               (f"{resume}[delayed]", "passed", ""), (f"{resume}[current]", "failed", "E  gap"),
                               (f"{resume}[block]", "skipped", "Skipped: no"))]
    recs += [cell(m, "hf-bf16", 10000, 5.0), cell(m, "hf-bf16-compile", 12000, 5.0),
             cell(m, "hf-fp8-tensorwise", 18000, 5.02), cell(m, "te-bf16", 22000, 5.0),
             cell(m, "te-fp8-delayed", 30000, 5.025), cell(m, "te-fp8-current", 28000, 5.1),
             cell(m, "te-fp8-mxfp8", None, status="refused",
                  message="llama-fp8 train: error: mxfp8 needs compute capability >= 10.0"),
             cell(m, "hf-fp8-rowwise", None, status="failed", message="train: exit 1\nCUDA OOM")]
    return recs


def render(tmp_path, records) -> str:
    path = tmp_path / "visit.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return results.render([path])


def test_the_committed_page_is_current():
    paths = sorted((results.REPO / "docs" / "gpu-results").glob("*.jsonl"))
    committed = (results.REPO / "docs" / "gpu-results.md").read_text()
    assert committed == results.render(paths), "run: python scripts/gpu/results.py"
    assert results.main(["--check"]) == 0


def test_no_results_says_no_visit_happened(tmp_path):
    assert "No GPU visit has happened yet" in results.render([])
    out = tmp_path / "page.md"
    assert results.main(["--results-dir", str(tmp_path), "--out", str(out), "--check"]) == 1  # no page yet
    assert results.main(["--results-dir", str(tmp_path), "--out", str(out)]) == 0
    assert "No GPU visit has happened yet" in out.read_text()


def test_a_visit_renders_ratios_gaps_and_failures(tmp_path):
    page = render(tmp_path, visit())
    assert "## NVIDIA H100 80GB HBM3 (results key `sm90-0123456789`)" in page
    assert "| Transformer Engine | 2.20.2 |" in page and "| code | src abc, git d2 |" in page
    row = next(x for x in page.splitlines() if x.startswith("| te-fp8-delayed |"))
    cols = [c.strip() for c in row.split("|")[1:-1]]
    # samples/s, tokens/s/GPU; speed-up (samples/s rates) over the same implementation's BF16 30000/22000; loss gap
    # (5.025-5.0)/5.0
    assert cols[1:3] == [f"{30000 / 8192:.2f}", "30,000"] and cols[6:8] == ["1.36x", "+0.50 %"]
    assert cols[3] == f"{100 * 30000 * 2e-2 / 989.4:.1f} %"
    row = next(x for x in page.splitlines() if x.startswith("| hf-fp8-tensorwise |"))
    assert [c.strip() for c in row.split("|")[1:-1]][6:8] == ["1.50x", "+0.40 %"]  # vs the compiled BF16
    assert "| te-fp8-mxfp8 | refused: llama-fp8 train: error: mxfp8 needs compute capability >= 10.0 |" in page
    assert "| hf-fp8-rowwise | failed: train: exit 1 |" in page
    assert "2 failed, 2 passed, 2 skipped (6 tests)" in page and "| `tests/a.py::test_bad` | failed | E  wrong |" in page
    assert "- `train/llama3.2-3b/synthetic/hf-fp8-rowwise`: failed: train: exit 1" in page
    assert "### The headline: TE BF16 vs TE FP8, interleaved pairs\n\nNot measured." in page  # no headline run here
    assert "## Needs more than one GPU" in page and "cross-rank amax reduction" in page


def headline(windows: dict[str, list[float]]) -> list[dict]:
    """The four headline runs with these samples/s windows (unit suffix -> windows)."""
    recs = []
    for suffix, w in windows.items():
        variant, _, pair = suffix.partition("/")
        rec = cell("llama3.2-1b", variant, 8192 * len(w) / sum(1 / x for x in w), pair=int(pair[4:] or 1))
        rec["unit"] += "/" + pair if pair else ""
        recs.append({**rec, "windows": [[10 + 5 * i, x] for i, x in enumerate(w)]})
    return recs


def test_the_headline_states_its_interval_from_the_windows(tmp_path):
    """FP8 12 samples/s in every window against BF16's 10 in pair 1, 15 against 10 in pair 2: the point is the
    geometric mean sqrt(1.2 * 1.5); the bootstrap draws pairs, so the interval runs from pair 1's ratio to pair 2's."""
    page = render(tmp_path, headline({"te-bf16": [10.0] * 3, "te-fp8-current": [12.0] * 3,
                                      "te-fp8-current/pair2": [15.0] * 3, "te-bf16/pair2": [10.0] * 3}))
    assert f"samples/s: {(1.2 * 1.5) ** 0.5:.3f}x** (geometric mean over 2 pairs; 95 % CI 1.200-1.500, a bootstrap " \
           "over the pairs and their 12 logged windows after the warm-up" in page


def test_a_record_without_windows_takes_them_from_its_runs_metrics_file(tmp_path):
    """The first visit's records predate the field: its runs' metrics.jsonl, as they came back, are committed in
    metrics/KEY/; the windows after the warm-up (step > 10 here) are read from there, and without the file, none."""
    recs = headline({"te-bf16": [10.0], "te-fp8-current": [12.0]})
    del recs[1]["windows"]
    (tmp_path / "visit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert "95 % CI" not in results.render([tmp_path / "visit.jsonl"])
    run = tmp_path / "metrics" / KEY / "train_llama3.2-1b_synthetic_te-fp8-current.jsonl"
    run.parent.mkdir(parents=True)
    run.write_text("".join(json.dumps({"type": "train", "step": s, "samples_per_sec": x}) + "\n"
                           for s, x in ((5, 1.0), (10, 2.0), (15, 12.0), (20, 12.0))))
    assert "95 % CI 1.200-1.200" in results.render([tmp_path / "visit.jsonl"])


def test_numbers_of_two_gpus_are_never_compared(tmp_path):
    """One key (Hopper, same versions), two GPUs: the H200's FP8 cell is not divided by the H100's BF16 cell; each
    GPU gets its own section with its own versions and driver."""
    h200 = [{**cell("llama3.2-3b", "te-fp8-current", 40000), "gpu": "NVIDIA H200"},
            {"key": KEY, "gpu": "NVIDIA H200", "unit": "versions", "kind": "versions", "status": "passed",
             "versions": {**VERSIONS, "gpu": "NVIDIA H200", "driver": "575.57.08"}, "date": "2026-12-02T09:00:00+00:00"}]
    page = render(tmp_path, visit() + h200)
    h100_part, h200_part = page.split("## NVIDIA H200 (results key `sm90-0123456789`)")
    assert "## NVIDIA H100 80GB HBM3 (results key `sm90-0123456789`)" in h100_part
    assert "| driver | 575.57.08 |" in h200_part and "| driver | 580.159.04 |" in h100_part
    row = next(x for x in h200_part.splitlines() if x.startswith("| te-fp8-current |"))
    assert [c.strip() for c in row.split("|")[1:-1]][2] == "40,000"
    assert [c.strip() for c in row.split("|")[1:-1]][6:8] == ["", ""]  # no BF16 cell on the H200: no ratio
    assert "| 28,000 |" in h100_part and "| 40,000 |" not in h100_part


def test_take_back_and_check_contradict(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        results.main(["--take-back", str(tmp_path), "--check"])
    assert e.value.code == 2 and "give one" in capsys.readouterr().err
    assert results.main(["--take-back", str(tmp_path / "nowhere"), "--results-dir", str(tmp_path)]) == 2
    assert "--take-back" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_take_back_appends_the_new_records_keeps_the_wheel_and_regenerates_the_page(tmp_path, capsys):
    local = tmp_path / "docs" / "results.jsonl"
    local.parent.mkdir()
    old = visit()[:2]
    local.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in old))
    files_at = tmp_path / "files"
    (files_at / "built" / "te2.20.2-torch2.11.0_cu130-cp312").mkdir(parents=True)
    (files_at / "built" / "te2.20.2-torch2.11.0_cu130-cp312" / "w.whl").write_bytes(b"wheel")
    # the device's file: the local records, then its own (the last one cut off by a kill)
    returned = [json.dumps(r, sort_keys=True) for r in visit()[:5]] + ['{"key": "x", "unit": "y", "sta']
    (files_at / "results.jsonl").write_text("\n".join(returned) + "\n")
    page = tmp_path / "page.md"
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / kit.MANIFEST).write_text(json.dumps({"target": {"python": "3.12"}, "files": {}}))
    argv = ["--take-back", str(files_at), "--results-dir", str(local.parent), "--wheels", str(tmp_path / "kit"),
            "--out", str(page)]
    assert results.main(argv) == 0
    assert [json.loads(x)["unit"] for x in local.read_text().splitlines()] == [r["unit"] for r in visit()[:5]]
    assert (tmp_path / "kit" / "built" / "te2.20.2-torch2.11.0_cu130-cp312" / "w.whl").read_bytes() == b"wheel"
    assert kit.verify(tmp_path / "kit")["target"] == {"python": "3.12"}  # the manifest lists it, its target kept
    assert "| `tests/a.py::test_mx` | skipped |" in page.read_text()
    out = capsys.readouterr().out
    assert "3 new records" in out and "failed       test:tests/a.py::test_bad" in out
    assert results.main(argv) == 0 and len(local.read_text().splitlines()) == 5  # idempotent


def test_the_script_runs_as_the_runbook_calls_it(tmp_path):
    """`python scripts/gpu/results.py ...` as the runbook writes it (not imported by a test with scripts/offline on
    sys.path): it finds its helpers (versions.py lies in scripts/offline) and takes a returned folder back."""
    import subprocess
    import sys

    files_at = tmp_path / "files"
    files_at.mkdir()
    (files_at / "results.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in visit()[:3]))
    script = results.REPO / "scripts" / "gpu" / "results.py"
    proc = subprocess.run([sys.executable, str(script), "--take-back", str(files_at), "--results-dir",
                           str(tmp_path / "docs"), "--wheels", str(tmp_path / "kit"), "--out", str(tmp_path / "p.md")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "3 new records" in proc.stdout and "## NVIDIA H100 80GB HBM3" in (tmp_path / "p.md").read_text()
