"""What each run ran with, as the report reads it from the run folder: settings as run, the warning at start, the
MFU against the run's own format's peak; and the grouping of `compare --arms`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llama_fp8.report import compare, settings
from llama_fp8.report.runs import load_run


def write_run(d: Path, *, fmt: str, notes: list[str], mfu_key: str | None, compile_: bool = True) -> None:
    d.mkdir(parents=True)
    recs = [{"type": "meta", "precision": "bf16" if fmt == "" else f"fp8-te-{fmt}", "fp8_emulated": False}]
    for s in range(1, 11):
        rec = {"type": "train", "step": s, "loss": 5.0, "samples_per_sec": 10.0, "tflops_per_device": 100.0}
        if mfu_key:
            rec[mfu_key] = 0.1 * (1 + s % 2)  # windows of 0.1 and 0.2: their rate is the harmonic mean
        recs.append(rec)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    prec = {"backend": "none"} if fmt == "" else {"backend": "te", "format": fmt, "all_gather": True, "notes": notes,
                                                  "bf16_tail": "decoder blocks 27-31 (5 of 32) and the output layer"}
    (d / "config.yaml").write_text(yaml.safe_dump({"asked": {"compile": compile_, "activation_checkpointing": "full"},
                                                   "resolved": {"precision": prec}}))


def test_settings_and_the_format_s_mfu_come_from_the_run_folder(tmp_path):
    write_run(tmp_path / "nv", fmt="nvfp4", notes=["eager, slower"], mfu_key="mfu_vs_fp4_peak")
    run = load_run(str(tmp_path / "nv"), "run")
    s = settings.settings(run)
    assert (s["format"], s["compile"], s["all_gather"], s["activation_checkpointing"], s["notes"]) == \
        ("nvfp4", True, True, "full", ["eager, slower"])
    assert settings.line(s) == ("compile on, FP8 all-gather on, activation checkpointing full, decoder blocks 27-31 "
                                "(5 of 32) and the output layer")
    mfu, key = settings.format_mfu(run, warmup=2)
    assert key == "mfu_vs_fp4_peak" and mfu == pytest.approx(8 / (4 / 0.1 + 4 / 0.2))  # steps 3-10
    write_run(tmp_path / "bf", fmt="", notes=[], mfu_key="mfu_vs_bf16_peak", compile_=False)
    bf = load_run(str(tmp_path / "bf"), "run")
    assert settings.format_mfu(bf, 0)[1] == "mfu_vs_bf16_peak" and settings.settings(bf)["compile"] is False
    (tmp_path / "old").mkdir()  # an older run: FP8 by its label, its settings not recorded
    (tmp_path / "old" / "metrics.jsonl").write_text(json.dumps({"type": "train", "step": 1, "loss": 1.0,
                                                                "precision": "fp8-torchao-tensorwise"}) + "\n")
    old = settings.settings(load_run(str(tmp_path / "old"), "run"))
    assert old["format"] == "fp8" and settings.line(old).startswith("compile n/a, FP8 all-gather n/a")


def test_the_two_arm_report_states_each_run_s_settings_and_its_warning(tmp_path):
    write_run(tmp_path / "a", fmt="", notes=[], mfu_key=None)
    write_run(tmp_path / "b", fmt="mxfp8", notes=["a torchao arm runs eager"], mfu_key=None, compile_=False)
    rc = compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "rep")])
    report = (tmp_path / "rep" / "report.md").read_text()
    assert rc == 0 and "- as run: compile off, FP8 all-gather on, activation checkpointing full" in report
    assert "- warned at start: a torchao arm runs eager" in report


def test_compare_arms_refuses_runs_that_do_not_make_whole_groups(tmp_path, capsys):
    for name in "abcde":
        write_run(tmp_path / name, fmt="", notes=[], mfu_key=None)
    assert compare.main([*(str(tmp_path / n) for n in "abcde"), "--arms", "3"]) == 2
    assert "--arms 3: runs come in groups of 3 (the baseline then 2 candidates per repeat), got 5" in \
        capsys.readouterr().err
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--arms", "9"]) == 2
    assert "--arms 9: between 2 and 8" in capsys.readouterr().err
