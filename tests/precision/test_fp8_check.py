"""BF16 exceptions by layer (--fp8_exclude) and "is FP8 really on?" (coverage, all-gather dtypes, stop)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import build_meta, read_metrics, run_cli
from llama_fp8 import config as C
from llama_fp8 import models
from llama_fp8 import precision as P
from llama_fp8 import train as T
from llama_fp8.errors import ConfigError
from llama_fp8.precision import exclude as X
from llama_fp8.precision import verify as V

CPU = torch.device("cpu")
HF = models.get("hf")


def converted(*args: str):
    cfg = C.parse_args(["--model", "tiny", "--fp8", "1", "--fp8_backend", "torchao", *args])
    choice = P.resolve(cfg, HF, CPU)
    runtime = P.build(choice, HF, cfg)
    return runtime, runtime.convert(build_meta(cfg)), choice


def fp8_names(model) -> set[str]:
    return {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}


def test_fp8_exclude_keeps_the_matching_layers_out_of_the_conversion():
    _, full, _ = converted()
    runtime, part, choice = converted("--fp8_exclude", "model.layers.0.*,model.layers.3.mlp.down_proj")
    assert choice.exclude == ("model.layers.0.*", "model.layers.3.mlp.down_proj")  # the resolved plan records it
    removed = fp8_names(full) - fp8_names(part)
    assert removed == {f"model.layers.0.{s}" for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                       "mlp.down_proj")} | {"model.layers.3.mlp.down_proj"}
    assert fp8_names(part) < fp8_names(full)
    cov = V.coverage_record(runtime.layers(part))
    assert cov["fp8_linears"] == len(fp8_names(full)) - 8 and cov["linears"] == len(fp8_names(full)) + 1
    assert cov["high_precision"]["model.layers.3.mlp.down_proj"] == \
        "user exception (--fp8_exclude model.layers.3.mlp.down_proj)"
    assert cov["high_precision"]["lm_head"] == "output head"
    # the FLOP share is by in*out: recompute it from the modules themselves
    flops = {n: m.in_features * m.out_features for n, m in part.named_modules() if isinstance(m, torch.nn.Linear)}
    want = sum(flops[n] for n in fp8_names(part)) / sum(flops.values())
    assert cov["fp8_flop_share"] == pytest.approx(want)
    line = V.coverage_line(cov)
    assert line.startswith(f"FP8 coverage: {cov['fp8_linears']}/{cov['linears']} linear layers in FP8, ")
    assert "user exception (--fp8_exclude model.layers.0.*)" in line


@pytest.mark.parametrize("bad, says", [("model.layers.0.*,", "not a module-name glob"),
                                       ("model layers", "not a module-name glob"),
                                       ("../x", "not a module-name glob"),
                                       ("model.layers.99.*", "matches no FP8-capable layer")])
def test_fp8_exclude_refuses_bad_or_unmatched_globs(bad, says):
    with pytest.raises(ConfigError, match="--fp8_exclude") as e:
        converted("--fp8_exclude", bad)
    assert says in str(e.value)


def test_dims_not_divisible_by_16_are_named_as_the_reason():
    runtime, model, _ = converted("--hidden_width", "72", "--intermediate_size", "200", "--num_heads", "4",
                                  "--num_key_value_heads", "4")
    cov = V.coverage_record(runtime.layers(model))
    assert cov["high_precision"]["model.layers.0.mlp.up_proj"] == "dims not divisible by 16"  # 72 x 200


def tiny(tmp_path, *extra: str) -> C.TrainConfig:
    return C.parse_args(["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
                         "--max_steps", "3", "--fp8", "1", "--fp8_backend", "torchao", "--model_impl", "hf",
                         "--run_dir", str(tmp_path / "run"), *extra])


def test_a_run_whose_conversion_is_patched_away_stops_naming_it(tmp_path, monkeypatch, capsys):
    import torchao.float8 as ao

    monkeypatch.setattr(ao, "convert_to_float8_training", lambda model, **kw: model)
    assert T.run(tiny(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "FP8 was asked for but is not on: no linear layer runs in FP8 (0/" in err
    assert "should run in FP8 do not: model.layers.0.self_attn.q_proj" in err
    check = [r for r in read_metrics(tmp_path / "run") if r["type"] == "fp8_check"]
    assert check[0]["fp8_linears"] == 0 and check[0]["problems"]  # the record says why before the stop
    assert not [r for r in read_metrics(tmp_path / "run") if r["type"] == "train" and r["step"] == 3]


def test_fp8_verify_warn_lets_the_same_run_finish(tmp_path, monkeypatch, capsys):
    import torchao.float8 as ao

    monkeypatch.setattr(ao, "convert_to_float8_training", lambda model, **kw: model)
    assert T.run(tiny(tmp_path, "--fp8_verify", "warn")) == 0
    assert "WARNING llama_fp8.precision.verify: FP8 was asked for but is not on" in capsys.readouterr().err


def test_a_healthy_run_writes_its_coverage_record(tmp_path):
    assert T.run(tiny(tmp_path, "--fp8_exclude", "model.layers.1.*")) == 0
    (check,) = [r for r in read_metrics(tmp_path / "run") if r["type"] == "fp8_check"]
    assert (check["fp8_linears"], check["linears"], check["problems"]) == (7, 15, [])
    assert set(check["high_precision"]) == {"lm_head", *(f"model.layers.1.{s}" for s in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))}


def test_a_bf16_all_gather_of_fp8_weights_is_a_problem():
    class Param:
        _param_fqn = "model.layers.0.mlp.up_proj.weight"

    meter = V.AllGatherMeter({"model.layers.0.mlp.up_proj.weight"})
    meter._count([Param()], [[torch.bfloat16]], [[1000]])
    assert meter.by_dtype == {"bfloat16": 2000}
    cov = {"fp8_linears": 1, "linears": 2, "fp8_flop_share": 0.5, "high_precision": {"lm_head": "output head"}}
    (issue,) = V.problems(cov, True, meter)
    assert "--fp8_all_gather 1 but FSDP2 all-gathered FP8 layers' weights in high precision" in issue
    assert "model.layers.0.mlp.up_proj.weight" in issue
    assert V.problems(cov, False, meter) == []  # asked without FP8 all-gather: BF16 is right
    assert V.problems(cov, True, V.AllGatherMeter(set())) == []  # nothing all-gathered (one rank)


# Kernel names as CUDA 13's cuBLASLt, older cuBLAS/CUTLASS, Inductor and Transformer Engine name them on Hopper.
FP8_GEMMS = ["nvjet_qqtst_128x256_128x6_1x2_h_bz_coopA_TNT",
             "nvjet_qqtst_128x256_128x6_2x2_2cta_h_bz_Avec32UE8M0_Bvec32UE8M0_TNT",
             "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_cgasize1x2x1_stage4_gmmastage2_"
             "warpgroupsize1x1x1_tensor64x128x32",
             "sm90_xmma_gemm_e4m3f32_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off",
             "cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_f32_void_f16_128x128x64_1x1x1_0_tnn_align16",
             "triton_tem_fused__scaled_mm_0"]
BF16_GEMMS = ["nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN",
              "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off",
              "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn",
              "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_void_bf16_128x256x64_2x1x1_0_tnn_align8",
              "triton_tem_fused_mm_0"]
NOT_GEMMS = ["triton_poi_fused__to_copy_clamp_mul_0", "triton_red_fused_abs_max_0",
             "void transformer_engine::detail::cast_transpose_general_kernel<8ul, 8ul, __nv_bfloat16, __nv_fp8_e4m3>"
             "(__nv_bfloat16 const*, float const*, __nv_fp8_e4m3*, __nv_fp8_e4m3*, float const*, float*, float*, "
             "unsigned long, unsigned long)",
             "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, ...)",
             "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
             "flash_fwd_kernel", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128"]


def test_an_nvjet_gemm_is_fp8_by_its_operand_letters_only():
    """The shape of nvjet names, not kernels seen: an architecture prefix is read past, and a q after the two
    operand letters (an output or accumulator type) does not make a BF16 GEMM an FP8 one."""
    assert V.gemm_kind("nvjet_sm100_qqtst_256x256_128x4_2x1_2cta_v_bz_TNT") == "fp8"
    assert V.gemm_kind("nvjet_sm100_tst_256x256_64x4_2x1_2cta_v_bz_TNT") == "other"
    assert V.gemm_kind("nvjet_ttsq_128x256_64x4_1x2_h_bz_coopA_TNT") == "other"


@pytest.mark.parametrize("name", FP8_GEMMS)
def test_fp8_gemm_kernels_are_recognized_by_their_real_names(name):
    assert V.gemm_kind(name) == "fp8"


@pytest.mark.parametrize("name", BF16_GEMMS)
def test_a_bf16_gemm_is_never_taken_for_fp8(name):
    assert V.gemm_kind(name) == "other"


@pytest.mark.parametrize("name", NOT_GEMMS)
def test_casts_and_other_kernels_are_not_gemms(name):
    assert V.gemm_kind(name) is None


def fake_profile(kernels: dict[str, tuple[int, float]], cpu_ops: dict[str, int]) -> list:
    """What ``prof.key_averages()`` gives: one entry per name, CUDA kernels with their device time (us)."""
    import types

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    return ([types.SimpleNamespace(key=k, count=n, device_time_total=us, device_type=cuda)
             for k, (n, us) in kernels.items()]
            + [types.SimpleNamespace(key=k, count=n, device_time_total=0.0, device_type=cpu)
               for k, n in cpu_ops.items()])


def test_every_gemm_kernel_seen_is_recorded_with_calls_and_time_and_casts_are_not_counted():
    """A compiled torchao step on Hopper with CUDA 13: FP8 GEMMs named nvjet_qq..., the output head in BF16
    (nvjet_tst...), casts as Triton kernels named after their ops, and torchao's op on the CPU side."""
    events = fake_profile({FP8_GEMMS[0]: (42, 8400.0), BF16_GEMMS[0]: (3, 2100.0), NOT_GEMMS[0]: (84, 900.0),
                           NOT_GEMMS[2]: (10, 50.0)}, {"aten::_scaled_mm": 42, "aten::mm": 3})
    ev = V.evidence(events)
    assert ev["gemm_kernels"] == [{"name": FP8_GEMMS[0], "calls": 42, "ms": 8.4, "fp8": True},
                                  {"name": BF16_GEMMS[0], "calls": 3, "ms": 2.1, "fp8": False}]
    assert (ev["fp8_gemm_kernels"], ev["scaled_mm_calls"]) == (1, 42)
    assert V.evidence_notes(ev) == []
    line = V.evidence_line(ev)
    assert line.startswith("GEMM kernels in the profiled step: 2 (1 named as FP8); aten::_scaled_mm calls: 42")


def test_kernel_evidence_alone_never_stops_a_run_whose_coverage_proves_fp8():
    """Only BF16-named GEMMs and no scaled-mm op (names not confirmed on a GPU yet): a note that names the GEMM
    kernels seen, not a problem."""
    ev = V.evidence(fake_profile({BF16_GEMMS[0]: (45, 9000.0), NOT_GEMMS[0]: (84, 900.0)}, {}))
    cov = {"fp8_linears": 14, "linears": 15, "fp8_flop_share": 0.9, "high_precision": {"lm_head": "output head"}}
    assert V.problems(cov, False, None) == []
    (note,) = V.evidence_notes(ev)
    assert "no GEMM kernel named as FP8 and no aten::_scaled_mm" in note and "decides nothing" in note
    assert BF16_GEMMS[0] in note


def test_torchaos_fp8_matmuls_are_seen_as_scaled_mm_ops_in_a_real_profiled_step():
    """The real profiler path on CPU (torch runs _scaled_mm on CPU): a non-emulated Float8Linear stack, one
    forward and backward profiled by the Verifier: 3 scaled matmuls per layer (output, input grad, weight grad)."""
    import torchao.float8 as ao

    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    ao.convert_to_float8_training(model.to(torch.bfloat16), config=ao.Float8LinearConfig(emulate=False))
    layers = [V.LinearLayer(n, 32 * 64, True, None) for n, m in model.named_modules()
              if type(m).__name__ == "Float8Linear"]
    verifier = V.Verifier(lambda m: layers, lambda m: set(), False, True, "error")
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    for _ in range(2):
        model(x).float().sum().backward()
        verifier.after_step(model)
    records = []
    verifier.report(lambda rec, line: records.append((rec, line)))
    ((rec, line),) = records
    assert rec["scaled_mm_calls"] == 6 and rec["problems"] == [] and rec["notes"] == []
    assert "aten::_scaled_mm calls: 6" in line


@pytest.mark.slow
def test_all_gather_bytes_of_fp8_weights_halve_with_fp8_all_gather_on_2_gloo_ranks(tmp_path):
    got = {}
    for ag in ("0", "1"):
        run_dir = tmp_path / f"ag{ag}"
        r = run_cli(["train", "--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
                     "--max_steps", "2", "--fp8", "1", "--fp8_backend", "torchao", "--fp8_recipe", "tensorwise",
                     "--model_impl", "hf", "--fp8_all_gather", ag, "--run_dir", str(run_dir)], nproc=2)
        assert r.returncode == 0, r.stderr[-2000:]
        (check,) = [rec for rec in read_metrics(run_dir) if rec["type"] == "fp8_check"]
        got[ag] = check["all_gather_bytes"]
        assert check["problems"] == []
        assert check["fp8_weights_all_gathered"] == check["fp8_linears"] == 14  # every FP8 weight checked by name
    assert set(got["0"]) == {"bfloat16"} and got["1"]["float8_e4m3fn"] > 0
    # the FP8 layers' weights left the BF16 bytes and came back at one byte per element: exactly half
    assert got["0"]["bfloat16"] - got["1"]["bfloat16"] == 2 * got["1"]["float8_e4m3fn"]
    json.dumps(got)


def test_exclude_globs_parse_and_match():
    assert X.parse(None) == () and X.parse(" ") == ()
    assert X.parse("a.*, a.*,b.[0-3].c") == ("a.*", "b.[0-3].c")  # trimmed, duplicates dropped, order kept
    assert X.match("model.layers.31.mlp.up_proj", ("model.layers.3.*", "model.layers.31.*")) == "model.layers.31.*"
    assert X.match("model.layers.3.mlp.up_proj", ("model.layers.31.*",)) is None


FALLBACK_SCRIPT = '''
import sys
from llama_fp8.precision.torchao import TorchaoFp8
convert = TorchaoFp8.convert
def convert_without_fp8_all_gather(self, model):
    self.all_gather = False  # as a framework that ignores the flag: the FP8 layers' weights travel in BF16
    return convert(self, model)
TorchaoFp8.convert = convert_without_fp8_all_gather
from llama_fp8.__main__ import main
sys.exit(main())
'''


@pytest.mark.slow
def test_a_silent_bf16_all_gather_on_2_gloo_ranks_stops_the_run_naming_it(tmp_path):
    """--fp8_all_gather 1 asked, the conversion done without it (torchtitan#3123's silent fallback): FSDP2
    sends the FP8 layers' weights in BF16, the check sees it in the bytes and the run stops on every rank."""
    (script := tmp_path / "fallback.py").write_text(FALLBACK_SCRIPT)
    run_dir = tmp_path / "run"
    r = run_cli(["train", "--model", "tiny", "--device", "cpu", "--num_layers", "1", "--max_context_width", "32",
                 "--max_steps", "3", "--fp8", "1", "--fp8_backend", "torchao", "--fp8_recipe", "tensorwise",
                 "--model_impl", "hf", "--fp8_all_gather", "1", "--run_dir", str(run_dir)], nproc=2,
                script=str(script))
    assert r.returncode != 0, r.stdout[-2000:]
    assert "--fp8_all_gather 1 but FSDP2 all-gathered FP8 layers' weights in high precision" in r.stderr, \
        r.stderr[-3000:]
    (check,) = [rec for rec in read_metrics(run_dir) if rec["type"] == "fp8_check"]
    assert set(check["all_gather_bytes"]) == {"bfloat16"} and check["problems"]
    assert not [rec for rec in read_metrics(run_dir) if rec["type"] == "train" and rec["step"] == 3]
