"""The Chrome-trace summary (top kernels, the share of GEMMs, attention, FP8 casts, communication and idle) on a
small trace written here, with known answers."""

from __future__ import annotations

import gzip
import json

import pytest

from llama_fp8.report import trace as gpu_trace


def kernel(name: str, ts: float, dur: float, cat: str = "kernel", stream: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": stream}


# A 1000 us GPU window (ts 1000..2000): compute on stream 7, an all-gather on stream 20 overlapping it.
EVENTS = [
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#21", "ts": 900, "dur": 600, "pid": 1, "tid": 1},
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#22", "ts": 1500, "dur": 500, "pid": 1, "tid": 1},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 950, "dur": 10, "pid": 1, "tid": 1},  # CPU: ignored
    kernel("sm90_xmma_gemm_e4m3bf16_bf16f32_f32_tn_n_tilesize128x128x128", 1000, 290),
    kernel("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", 1300, 100),
    kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", 1400, 150),
    kernel("transformer_engine::cast_transpose_kernel<float, __nv_fp8_e4m3>", 1550, 50),
    kernel("void transformer_engine::amax_kernel<4>", 1600, 20),
    kernel("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", 1620, 80),
    kernel("Memcpy DtoD (Device -> Device)", 1700, 50, cat="gpu_memcpy"),
    kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1200, 400, stream=20),
    kernel("sm90_xmma_gemm_e4m3bf16_bf16f32_f32_tn_n_tilesize128x128x128", 1900, 100),
]


def test_classes():
    assert gpu_trace.classify("sm90_xmma_gemm_e4m3bf16_bf16f32") == "gemm"  # an FP8 GEMM is a GEMM, not a cast
    assert gpu_trace.classify("cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>") == "attention"
    assert gpu_trace.classify("triton_red_fused_abs_amax_0") == "fp8_cast"
    assert gpu_trace.classify("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "communication"
    assert gpu_trace.classify("multi_tensor_apply_kernel") == "other"
    assert gpu_trace.classify("Memcpy HtoD", "gpu_memcpy") == "memcpy"


def test_shares_idle_and_top_kernels_of_a_known_trace(tmp_path):
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS, "displayTimeUnit": "ms"}, f)
    s = gpu_trace.summarize(gpu_trace.load(path), top=3)
    assert s["gpu_events"] == 9 and s["window_ms"] == pytest.approx(1.0) and s["profiled_steps"] == 2
    share = s["share"]
    assert share["gemm"] == pytest.approx(0.49)  # 290 + 100 + 100 us of 1000
    assert share["attention"] == pytest.approx(0.15)
    assert share["fp8_cast"] == pytest.approx(0.07)
    assert share["communication"] == pytest.approx(0.4)  # overlaps compute: shares may sum past 100 %
    assert share["memcpy"] == pytest.approx(0.05) and share["other"] == pytest.approx(0.08)
    assert share["idle"] == pytest.approx(0.15)  # 1750..1900 has no GPU event on any stream
    top = s["top_kernels"]
    assert [k["class"] for k in top] == ["communication", "gemm", "attention"]
    assert top[1]["calls"] == 2 and top[1]["ms"] == pytest.approx(0.39) and top[1]["share"] == pytest.approx(0.39)
    text = gpu_trace.format_summary(s)
    assert "gemm 49.0%" in text and "idle 15.0%" in text


def test_traces_are_found_in_a_run_dir_and_other_json_is_not_taken(tmp_path, capsys):
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "host.pt.trace.json").write_text(json.dumps(EVENTS))  # bare-array form
    (tmp_path / "metrics.jsonl").write_text('{"type": "meta"}\n')
    (tmp_path / "other.json").write_text('{"a": 1}')
    assert [p.name for p in gpu_trace.find_traces(tmp_path)] == ["host.pt.trace.json"]
    assert gpu_trace.main([str(tmp_path), "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "communication" in lines[1] and "gemm" in lines[2]  # the window line + 2 kernels
    assert gpu_trace.main([str(tmp_path / "profile" / "missing")]) == 1
    assert gpu_trace.summarize({"traceEvents": EVENTS[:3]})["gpu_events"] == 0
