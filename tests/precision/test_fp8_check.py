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
    (issue,) = V.problems(cov, True, meter, None)
    assert "--fp8_all_gather 1 but FSDP2 all-gathered FP8 layers' weights in high precision" in issue
    assert "model.layers.0.mlp.up_proj.weight" in issue
    assert V.problems(cov, False, meter, None) == []  # asked without FP8 all-gather: BF16 is right
    assert V.problems(cov, True, V.AllGatherMeter(set()), None) == []  # nothing all-gathered (one rank)


def test_no_fp8_kernel_in_the_profiled_step_is_a_problem():
    cov = {"fp8_linears": 1, "linears": 2, "fp8_flop_share": 0.5, "high_precision": {}}
    assert V.problems(cov, False, None, ["sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n"]) == []
    (issue,) = V.problems(cov, False, None, ["ampere_bf16_s16816gemm_bf16_128x64", "elementwise_kernel"])
    assert "no FP8 GEMM kernel ran" in issue


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
