"""fp8-bisect: the smallest set of decoder layers to keep in BF16, found in O(log L) runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from llama_fp8 import config as C
from llama_fp8 import fp8_bisect
from llama_fp8 import train as T
from llama_fp8.precision import torchao as AO


@pytest.mark.parametrize("faults, layers", [({5}, 8), ({0}, 32), ({31}, 32), ({3, 12}, 16), ({6, 7}, 8)])
def test_search_finds_exactly_the_faulty_layers(faults, layers):
    calls = []

    def good(excluded):
        calls.append(excluded)
        return faults <= set(excluded)

    assert sorted(fp8_bisect.smallest_exclusion(list(range(layers)), good)) == sorted(faults)
    if len(faults) == 1:
        assert len(calls) <= 2 * math.ceil(math.log2(layers))


def plant_fault(monkeypatch, layer: int) -> None:
    """Test-only: the FP8 cast of one decoder layer's linears is corrupted (their output overflows, as an FP8
    scale gone wrong would make it), so the fault exists only while that layer runs in FP8."""
    convert = AO.TorchaoFp8.convert

    def corrupted(self, model):
        model = convert(self, model)
        for name, m in model.named_modules():
            if type(m).__name__ == "Float8Linear" and name.startswith(f"model.layers.{layer}."):
                m.register_forward_hook(lambda mod, args, out: out * math.inf)
        return model

    monkeypatch.setattr(AO.TorchaoFp8, "convert", corrupted)


@pytest.mark.slow
def test_planted_fault_is_found_in_log_runs(tmp_path, monkeypatch, capsys):
    torch.set_num_threads(1)
    base = tmp_path / "base.yaml"
    base.write_text("model: tiny\ndevice: cpu\nmodel_impl: hf\nfp8_backend: torchao\nnum_layers: 8\n"
                    "max_context_width: 32\ntrain_batch_size: 2\n")
    plant_fault(monkeypatch, 5)
    out = tmp_path / "bisect"
    assert fp8_bisect.main(["--config", str(base), "--steps", "3", "--tolerance_pct", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--fp8_exclude model.layers.5.*" in printed
    result = json.loads((out / "bisect.json").read_text())
    assert result["excluded_layers"] == [5]
    # none, all, then halving 8 layers: at most 2 + 2*log2(8) FP8 runs (and one BF16 run)
    assert len(result["fp8_runs"]) <= 2 + 2 * math.ceil(math.log2(8))
    assert result["fp8_runs"][0]["excluded"] == [] and not result["fp8_runs"][0]["good"]
    assert "Use: `--fp8_exclude model.layers.5.*`" in (out / "bisect.md").read_text()
    # the value it prints works: that run is within tolerance of BF16
    cfg = C.parse_args(["--config", str(base), "--max_steps", "3", "--fp8", "1", "--fp8_exclude", result["fp8_exclude"],
                        "--run_dir", str(tmp_path / "check")])
    assert T.run(cfg) == 0
    gap = abs(fp8_bisect.final_loss(tmp_path / "check") - result["bf16_loss"]) / result["bf16_loss"] * 100
    assert gap <= 2.0


def test_bad_config_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\nno_such_key: 1\n")
    assert fp8_bisect.main(["--config", str(bad), "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert "no_such_key" in capsys.readouterr().out


@pytest.mark.slow
def test_bisection_works_for_a_block_format(tmp_path, monkeypatch, capsys):
    """torchao's emulated MXFP8 with a planted fault in block 2 of 4: the probes keep the run's recipe (every probe's
    config.yaml says mxfp8) and find block 2."""
    torch.set_num_threads(1)
    base = tmp_path / "base.yaml"
    base.write_text("model: tiny\ndevice: cpu\nmodel_impl: hf\nfp8_backend: torchao\nfp8_recipe: mxfp8\n"
                    "max_context_width: 32\ntrain_batch_size: 2\nval_batch_size: 1\n")
    convert = AO.TorchaoFp8.convert

    def corrupted(self, model):
        model = convert(self, model)
        for name, m in model.named_modules():
            if type(m).__name__ == "MXFP8Linear" and name.startswith("model.layers.2."):
                m.register_forward_hook(lambda mod, args, out: out * math.inf)
        return model

    monkeypatch.setattr(AO.TorchaoFp8, "convert", corrupted)
    out = tmp_path / "bisect"
    assert fp8_bisect.main(["--config", str(base), "--steps", "2", "--tolerance_pct", "2", "--out", str(out)]) == 0
    assert "--fp8_exclude model.layers.2.*" in capsys.readouterr().out
    result = json.loads((out / "bisect.json").read_text())
    assert result["excluded_layers"] == [2]
    import yaml

    probes = sorted(p for p in out.iterdir() if p.name.startswith("fp8-"))
    assert probes and all(yaml.safe_load((p / "config.yaml").read_text())["resolved"]["precision"]["recipe"] == "mxfp8"
                          for p in probes)
