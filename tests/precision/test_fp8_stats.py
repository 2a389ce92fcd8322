"""--fp8_stats: per-layer FP8 numerics match an independent computation on known tensors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from helpers import read_metrics
from llama_fp8 import config as C
from llama_fp8 import train as T
from llama_fp8.precision import fp8_stats as S

E4M3 = S.CastSpec(torch.float8_e4m3fn)


def test_known_tensor_by_hand():
    # amax 2 -> scale 448/2 = 224; 1e-6*224 is below e4m3's smallest subnormal (2^-9): it underflows;
    # 1*224 and -2*224 = -448 are exact in e4m3, and -448 reaches the maximum.
    t = torch.tensor([0.0, 1e-6, 1.0, -2.0])
    st = S.tensor_stats(t, E4M3)
    assert st["amax"] == 2.0 and st["scale"] == 224.0
    assert st["underflow"] == pytest.approx(1 / 3)  # of the 3 non-zero elements
    assert st["saturation"] == pytest.approx(1 / 4)
    assert st["snr_db"] == pytest.approx(10 * math.log10((1e-12 + 1 + 4) / 1e-12), rel=1e-6)


def test_rowwise_and_power_of_two_scales():
    t = torch.tensor([[1.0, 0.5], [4.0, -3.0]])
    st = S.tensor_stats(t, S.CastSpec(torch.float8_e4m3fn, rowwise=True))
    assert st["amax"] == 4.0 and st["scale"] == 112.0  # rows: 448/1 and 448/4; the smallest is reported
    pow2 = S.tensor_stats(torch.tensor([3.0, 1.0]), S.CastSpec(torch.float8_e4m3fn, pow2=True))
    assert pow2["scale"] == 128.0  # 448/3 = 149.3 rounded down to a power of two


def test_exact_tensor_has_no_noise_and_a_zero_tensor_has_no_snr():
    assert S.tensor_stats(torch.tensor([1.0, -0.5, 2.0]), E4M3)["snr_db"] is None  # all exact: no noise
    zero = S.tensor_stats(torch.zeros(8), E4M3)
    assert (zero["underflow"], zero["snr_db"]) == (0.0, None)


def test_random_tensor_against_an_independent_quantization():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(64, 48, generator=g) * torch.logspace(-8, 1, 48)  # columns spanning 9 decades
    st = S.tensor_stats(t, E4M3)
    scale = 448.0 / t.abs().max()
    q = (t * scale).to(torch.float8_e4m3fn).to(torch.float32) / scale
    nz = t != 0
    assert st["underflow"] == pytest.approx(((q == 0) & nz).sum().item() / nz.sum().item())
    assert st["underflow"] > 0.05  # the small columns do underflow
    assert st["snr_db"] == pytest.approx(10 * math.log10((t**2).sum().item() / ((t - q) ** 2).sum().item()), rel=1e-4)


def test_hooks_see_what_float8linear_sees_and_its_scale():
    import torchao.float8 as ao
    from torchao.float8.float8_utils import tensor_to_scale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 16, bias=False))
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    ao.convert_to_float8_training(model, config=config)
    stats = S.TorchaoStats(every=1)
    stats.attach(model)
    x, g = torch.randn(8, 32), torch.randn(8, 16) * 1e-3
    stats.before_step(1)
    (model(x) * g).sum().backward()
    recs = {(r["layer"], r["tensor"]): r for r in stats.take()}
    assert len(recs) == 6  # 2 layers x (input, weight, output gradient)
    assert recs[("0", "input")] == {"step": 1, "layer": "0", "tensor": "input", "dtype": "float8_e4m3fn",
                                    **S.tensor_stats(x, E4M3)}
    # torchao's own scale for that input is the one reported
    assert recs[("0", "input")]["scale"] == pytest.approx(tensor_to_scale(x, torch.float8_e4m3fn).item())
    assert recs[("1", "weight")]["amax"] == model[1].weight.abs().max().item()
    go = recs[("1", "grad_output")]
    assert go["dtype"] == "float8_e5m2" and go == {**go, **S.tensor_stats(g, S.CastSpec(torch.float8_e5m2))}
    stats.before_step(2)
    assert stats.active and S.TorchaoStats(every=50).active is False


@pytest.mark.slow
def test_a_run_with_fp8_stats_writes_one_line_per_layer_tensor_and_logged_step(tmp_path):
    cfg = C.parse_args(["--model", "tiny", "--device", "cpu", "--num_layers", "1", "--max_context_width", "32",
                        "--max_steps", "4", "--fp8", "1", "--fp8_backend", "torchao", "--model_impl", "hf",
                        "--fp8_stats", "2", "--run_dir", str(tmp_path / "run")])
    assert T.run(cfg) == 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "fp8_stats.jsonl").read_text().splitlines()]
    assert {r["step"] for r in lines} == {2, 4}
    assert len(lines) == 2 * 7 * 3  # 7 FP8 linears per block, 3 tensors each
    summaries = [r for r in read_metrics(tmp_path / "run") if r["type"] == "fp8_stats"]
    assert [r["step"] for r in summaries] == [2, 4]
    step2 = [r for r in lines if r["step"] == 2 and r["tensor"] == "input"]
    assert summaries[0]["input_underflow_max"] == max(r["underflow"] for r in step2)


@pytest.mark.slow
def test_fp8_stats_summaries_reach_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = C.parse_args(["--model", "tiny", "--device", "cpu", "--num_layers", "1", "--max_context_width", "32",
                        "--max_steps", "3", "--fp8", "1", "--fp8_backend", "torchao", "--model_impl", "hf",
                        "--fp8_stats", "1", "--run_dir", str(tmp_path / "run"), "--tensorboard_dir", str(tmp_path / "tb")])
    assert T.run(cfg) == 0
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    summaries = [r for r in read_metrics(tmp_path / "run") if r["type"] == "fp8_stats"]
    tb = acc.Scalars("fp8_stats/weight_snr_db_min")
    assert [e.step for e in tb] == [r["step"] for r in summaries] == [2, 3]
    assert [e.value for e in tb] == pytest.approx([r["weight_snr_db_min"] for r in summaries])
