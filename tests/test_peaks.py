"""The MFU peak table: exact SKUs by CUDA device name, n/a (never another GPU's peak) otherwise."""

from __future__ import annotations

import logging

import pytest
import torch

from llama_fp8.telemetry import metrics, peaks

# (CUDA device name as torch.cuda.get_device_name returns it, dense BF16, dense FP8)
KNOWN = [
    ("NVIDIA H100 80GB HBM3", 989.4, 1978.9),
    ("NVIDIA H100 PCIe", 756.0, 1513.0),
    ("NVIDIA H100 NVL", 835.5, 1670.5),
    ("NVIDIA H200", 989.4, 1978.9),
    ("NVIDIA H200 NVL", 835.5, 1670.5),
    ("NVIDIA H20", 148.0, 296.0),
    ("NVIDIA GH200 480GB", 989.4, 1978.9),
    ("NVIDIA B200", 2250.0, 4500.0),
    ("NVIDIA GB200", 2500.0, 5000.0),
    ("NVIDIA B300 SXM6 AC", 2250.0, 4500.0),
    ("NVIDIA GB300", 2500.0, 5000.0),
    ("NVIDIA L40S", 362.05, 733.0),
    ("NVIDIA L4", 121.0, 242.5),
    ("NVIDIA A100-SXM4-80GB", 312.0, None),
    ("NVIDIA A100 80GB PCIe", 312.0, None),
    ("NVIDIA A100-PCIE-40GB", 312.0, None),
]


@pytest.mark.parametrize("name, bf16, fp8", KNOWN)
def test_each_sku_gets_its_own_dense_peaks(name, bf16, fp8):
    assert peaks.resolve(name, None)[:2] == (bf16, fp8)


# Names a substring match got wrong: an L40 is not an L4, an H200 NVL is not an H200 SXM, a MIG slice has
# a fraction of the GPU, and GPUs missing from the table (or named ambiguously) have no peak at all.
@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA H100", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA H800",
                                  "NVIDIA A10", "NVIDIA RTX 6000 Ada Generation", "Tesla V100-SXM2-16GB",
                                  "NVIDIA H200 NVL MIG 3g.71gb"])
def test_unknown_ambiguous_or_mig_names_give_no_peak_and_a_hint(name, caplog):
    with caplog.at_level(logging.WARNING):
        bf16, fp8, where = peaks.resolve(name, None)
    assert (bf16, fp8) == (None, None) and where.startswith("n/a")
    assert "--peak_tflops" in caplog.text and name in caplog.text


def test_override_is_the_bf16_peak_and_fp8_twice_it():
    assert peaks.resolve("NVIDIA H800", 500.0)[:2] == (500.0, 1000.0)
    assert metrics.peak_tflops(torch.device("cpu"), 100.0) == ("cpu", 100.0, 200.0)
    assert metrics.peak_tflops(torch.device("cpu")) == ("cpu", None, None)


def test_every_row_is_dense_and_names_its_source():
    for p in peaks.PEAKS:
        assert "datasheet" in p.source or "product brief" in p.source, p
        assert p.fp8 is None or p.fp8 == pytest.approx(2 * p.bf16, rel=0.02), p  # dense FP8 ~ 2x dense BF16 (L40S: 733 vs 362.05)
    table = peaks.table_markdown()
    assert "| H200 NVL | 835.5 | 1670.5 |" in table and "| A100 | 312 | - |" in table


def test_log_line_names_both_peaks_for_fp8_and_only_bf16_otherwise():
    rec = {"step": 20, "loss": 8.421843, "samples_per_sec": 47.0612, "lr": 1e-4, "tokens_per_sec_per_device": 1.0,
           "tflops_per_device": 0.1, "mfu_vs_bf16_peak": 0.41, "mfu_vs_fp8_peak": 0.205, "mem_peak_gib": 1.0,
           "grad_norm": None, "is_fp8": True}
    line = metrics.format_line(rec)
    assert "MFU(bf16 peak): 0.410, MFU(fp8 peak): 0.205," in line
    bf16 = metrics.format_line({**rec, "is_fp8": False, "mfu_vs_fp8_peak": None})
    assert "MFU(bf16 peak): 0.410," in bf16 and "fp8 peak" not in bf16
    unknown = metrics.format_line({**rec, "mfu_vs_bf16_peak": None, "mfu_vs_fp8_peak": None})
    assert "MFU(bf16 peak): n/a, MFU(fp8 peak): n/a" in unknown


def test_log_parser_reads_both_labels_back():
    from llama_fp8.report.logparse import parse_log_line

    rec = {"step": 3, "loss": 1.0, "samples_per_sec": 1.0, "lr": 1e-4, "tokens_per_sec_per_device": 1.0,
           "tflops_per_device": 0.1, "mfu_vs_bf16_peak": 0.41, "mfu_vs_fp8_peak": 0.205, "mem_peak_gib": 1.0,
           "grad_norm": None, "is_fp8": True}
    back = parse_log_line(metrics.format_line(rec))
    assert (back["mfu_vs_bf16_peak"], back["mfu_vs_fp8_peak"]) == (0.41, 0.205)


def test_an_emulated_run_states_no_mfu_in_its_record_its_line_and_the_report(tmp_path):
    """FP8 emulated on a GPU that has a peak (torchao's MXFP8 on an H100): the TFLOPS are measured, but a
    utilization of the GPU's peak would read as if FP8 ran, so every MFU is blank, and the log line, the compare
    report and the arms table say why."""
    import json

    from llama_fp8.report import compare, settings
    from llama_fp8.report.runs import load_run

    def window(emulated: bool) -> dict:
        meter = metrics.StepMeter(torch.device("cpu"), 1, 2, 32, 1e9, 989.4, 1978.9, True, emulated=emulated)
        meter.add_step(torch.tensor(3.0), 0.0)
        return meter.window(1, 1e-4, None)

    real, emulated = window(False), window(True)
    assert real["mfu_vs_bf16_peak"] == pytest.approx(real["tflops_per_device"] / 989.4) and "fp8_emulated" not in real
    assert real["mfu_vs_fp8_peak"] == pytest.approx(real["tflops_per_device"] / 1978.9)
    assert emulated["tflops_per_device"] > 0
    assert (emulated["mfu_vs_bf16_peak"], emulated["mfu_vs_fp8_peak"], emulated["fp8_emulated"]) == (None, None, True)
    line = metrics.format_line(emulated)
    assert "MFU: n/a (FP8 emulated)," in line and "MFU(bf16 peak)" not in line
    # the report: an older run that logged an MFU while emulating has it blanked too, by its meta record
    recs = [{"type": "meta", "precision": "fp8-torchao-mxfp8", "precision_format": "mxfp8", "fp8_emulated": True}]
    recs += [{**real, "step": s, "type": "train"} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run = load_run(str(tmp_path / "metrics.jsonl"), "run")
    summary = compare.summarize_run(run, 1)
    assert summary["fp8_emulated"] and summary["mfu_vs_bf16_peak"] is None and summary["mfu_vs_fp8_peak"] is None
    assert summary["tflops_per_device"] > 0
    assert settings.format_mfu(run, 1)[0] is None
