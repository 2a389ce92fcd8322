"""The report's "Seeing FP8" section: coverage, all-gather bytes, exclusions, MFU convention, heatmaps and
the five worst layers, from the run folders' own records."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from llama_fp8.report import compare

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(d: Path, precision: str, *, stats: list[dict] | None = None, check: dict | None = None) -> None:
    d.mkdir(parents=True)
    recs = [{"type": "meta", "precision": precision, "device_name": "NVIDIA H100 80GB HBM3",
             "peak_tflops_bf16": 989.4, "peak_tflops_fp8": 1978.9,
             "peak_source": "H100 SXM: NVIDIA H100 Tensor Core GPU datasheet",
             "flops_convention": "causal attention counted in full"}]
    recs += [{"type": "train", "step": s, "loss": 5.0 - 0.01 * s, "samples_per_sec": 10.0, "lr": 1e-4,
              "tokens_per_sec_per_device": 100.0, "tflops_per_device": 400.0, "mfu_vs_bf16_peak": 0.4,
              "mem_peak_gib": 1.0} for s in range(1, 11)]
    if check:
        recs.append({"type": "fp8_check", "step": 2, **check})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "config.yaml").write_text(yaml.safe_dump({"asked": {"fp8_exclude": "model.layers.0.*" if check else None},
                                                   "resolved": {"precision": {"exclude": ["model.layers.0.*"]
                                                                              if check else []}}}))
    if stats is not None:
        (d / "fp8_stats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stats) + '{"step": 4, "lay')


def test_report_shows_coverage_bytes_exclusions_mfu_and_the_worst_layers(tmp_path):
    stats = []
    for step in (2, 4):
        for i in range(7):  # layer i has underflow i/100 on its input; its weight's SNR is 30 - i
            layer = f"model.layers.{i}.mlp.up_proj"
            stats.append({"step": step, "layer": layer, "tensor": "input", "underflow": i / 100, "snr_db": 40.0})
            stats.append({"step": step, "layer": layer, "tensor": "weight", "underflow": 0.0, "snr_db": 30.0 - i})
    check = {"fp8_linears": 13, "linears": 15, "fp8_flop_share": 0.5,
             "high_precision": {"lm_head": "output head", "model.layers.0.mlp.up_proj": "user exception "
                                "(--fp8_exclude model.layers.0.*)"},
             "all_gather_bytes": {"bfloat16": 2 * 2**20, "float8_e4m3fn": 2**20}, "problems": [],
             "gemm_kernels": [{"name": "nvjet_qqtst_128x256_128x6_1x2_h_bz_coopA_TNT", "calls": 42, "ms": 8.4,
                               "fp8": True}], "gemm_kernel_names": 1, "fp8_gemm_kernels": 1, "scaled_mm_calls": 42,
             "notes": ["a note"]}
    write_run(tmp_path / "a", "bf16")
    write_run(tmp_path / "b", "fp8-torchao-tensorwise", stats=stats, check=check)
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out")]) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    section = report[report.index("## Seeing FP8"):]
    assert "FP8 coverage: 13/15 linear layers in FP8, 50.0 % of linear FLOPs" in section
    assert "user exception (--fp8_exclude model.layers.0.*): model.layers.0.mlp.up_proj (1)" in section
    assert "FSDP all-gather bytes per step (this rank's inputs): bfloat16 2.00 MiB, float8_e4m3fn 1.00 MiB" in section
    assert "--fp8_exclude asked: `model.layers.0.*`; resolved: ['model.layers.0.*']" in section
    assert ("GEMM kernels in the profiled step: 1 (1 named as FP8); aten::_scaled_mm calls: 42; most time: "
            "nvjet_qqtst_128x256_128x6_1x2_h_bz_coopA_TNT x42 8.4 ms") in section
    assert "- note: a note" in section
    assert "dense BF16 peak 989.4 TFLOPS, MFU(fp8 peak) against the dense FP8 peak 1978.9 TFLOPS" in section
    assert "causal attention counted in full" in section
    worst = [ln.split(" | ")[0].lstrip("| ") for ln in section.splitlines() if ln.startswith("| model.layers.")]
    assert worst == [f"model.layers.{i}.mlp.up_proj" for i in (6, 5, 4, 3, 2)]  # most underflow first
    assert "| model.layers.6.mlp.up_proj | 6.00e-02 | 24.0 |" in section  # the lowest SNR of its tensors
    for name in ("fp8_underflow_b.png", "fp8_snr_b.png"):
        assert (tmp_path / "out" / name).read_bytes().startswith(PNG) and f"({name})" in section
    assert "fp8_underflow_a.png" not in section  # the BF16 run has no FP8 statistics
