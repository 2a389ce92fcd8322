"""estimate/layers.py: a deep model's tracked step from three shallow ones equals measuring every block, to the
byte (every count the estimate reports, and where each phase peaks); where the shallow ones do not show a line,
every block is measured."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llama_fp8 import config
from llama_fp8.estimate import build, cli, fake, layers, run
from llama_fp8.estimate.tracker import Where

# a small vocabulary and a long context: the peak in backward (in the last block with full AC)
BLOCK_PEAK = ["--model", "tiny", "--device", "cpu", "--model_impl", "hf", "--vocab_size", "256",
              "--max_context_width", "512", "--train_batch_size", "2"]
CASES = {  # (BF16 with selective AC: the 8B test below)
    "ac-full": ["--activation_checkpointing", "full"],
    "fp8-all-gather": ["--fp8", "1", "--fp8_all_gather", "1"],
    "tp2": ["--tp_size", "2"],
    "grad-accum-2": ["--grad_accum_steps", "2"],
}
FIELDS = ("peak_bytes", "by_kind", "where", "phase_peaks", "at_optimizer", "collectives", "num_params",
          "local_param_numel", "fp8_operand_bytes", "micro_batches", "group_ranks")


def measured(args: list[str], blocks: int, world: int = 4, gpus: int = 4) -> run.Measurement:
    cfg = config.parse_args([*args, "--num_layers", str(blocks)])
    with fake.process_group(world):
        return run.measure(cfg, build.env_for(world, gpus), fake_run=True)


def assert_same(got: run.Measurement, full: run.Measurement) -> None:
    for name in FIELDS:
        assert getattr(got, name) == getattr(full, name), name
    assert got.decision.cfg == full.decision.cfg


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_three_shallow_models_extended_equal_every_block_measured(case):
    args = [*BLOCK_PEAK, *CASES[case]]
    shallow = [measured(args, n) for n in (3, 4, 5)]
    full = measured(args, 13)
    got = layers.extend(shallow, 3, 13)
    assert got is not None
    got = dataclasses.replace(got, decision=dataclasses.replace(
        got.decision, cfg=dataclasses.replace(got.decision.cfg, num_layers=13)))
    assert_same(got, full)
    if case == "ac-full":  # the peak in a block: named as the deep model's last
        assert full.where.phase.startswith("backward") and "layers.12." in full.where.module, full.where


@pytest.mark.slow
def test_an_8b_estimate_from_three_shallow_models_equals_every_block_measured():
    """The README's 8B job (8 H100s, 2 x 8192, selective AC): its peak in backward, in the last of 32 blocks."""
    args = ["--model", "llama3.1-8b", "--model_impl", "hf", "--max_context_width", "8192", "--train_batch_size", "2",
            "--activation_checkpointing", "selective"]
    cfg = config.parse_args(args)
    env = build.env_for(8, 8)
    with fake.process_group(8):
        full = run.measure(cfg, env, fake_run=True)
    got = layers.measure(cfg, env)
    assert_same(got, full)
    assert full.where.module == "model.layers.31.mlp" and full.peak_bytes > 40 * 2**30


@pytest.mark.slow
def test_the_estimate_of_a_deep_model_is_the_same_report(capsys, monkeypatch):
    """Through `llama-fp8 estimate --json`: the report of a 26-block model extended is the one of every block
    measured, but for the seconds it took."""
    argv = ["--model", "tiny", "--model_impl", "hf", "--num_layers", "26", "--max_context_width", "256",
            "--train_batch_size", "2", "--nodes", "1", "--gpus_per_node", "4", "--suggest", "0", "--json"]
    calls = []
    real = run.measure
    monkeypatch.setattr(run, "measure", lambda cfg, *a, **k: calls.append(cfg.num_layers) or real(cfg, *a, **k))
    assert cli.main(argv) == 0
    extended = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(layers, "WORTH", 1000)
    assert cli.main(argv) == 0
    whole = json.loads(capsys.readouterr().out)
    assert calls == [3, 4, 5, 26]
    extended.pop("seconds"), whole.pop("seconds")
    assert extended == whole


def test_a_layer_indexed_option_or_a_bent_line_is_measured_whole(monkeypatch):
    calls = []

    def stub(bend: int):
        def measure(cfg, *a, **k):
            calls.append(cfg.num_layers)
            n = cfg.num_layers
            m = fabricated(n, 1000 + 100 * (n - 3) + (bend if n == 5 else 0), 600)
            return dataclasses.replace(m, decision=build.Decision(cfg, None, None, None))
        return measure

    cfg = config.parse_args(["--model", "tiny", "--num_layers", "40", "--fp8", "1", "--fp8_exclude", "last:4"])
    monkeypatch.setattr(run, "measure", stub(0))
    assert layers.measure(cfg, build.env_for(2, 2)).peak_bytes == 1000 + 100 * 37 and calls == [40]
    cfg = dataclasses.replace(cfg, fp8_exclude=None)
    assert layers.measure(cfg, build.env_for(2, 2)).peak_bytes == 1000 + 100 * 37 and calls == [40, 3, 4, 5]
    assert calls == [40, 3, 4, 5] and layers.measure(cfg, build.env_for(2, 2)).decision.cfg.num_layers == 40
    monkeypatch.setattr(run, "measure", stub(1))
    assert layers.measure(cfg, build.env_for(2, 2)).peak_bytes == 1000 + 100 * 37
    assert calls == [40, 3, 4, 5, 3, 4, 5, 3, 4, 5, 40]


def fabricated(blocks: int, backward: int, optimizer: int, module: str = "layers.{last}.mlp",
               bytes_per_block: int = 10) -> run.Measurement:
    """A measurement with two phases' peaks: backward (in a block) and the optimizer step."""
    where = Where("backward", module.format(last=blocks - 1), 1)
    peaks = [(backward, {"Activation": backward}, where), (optimizer, {"OptState": optimizer},
                                                           Where("optimizer step", "-", 1))]
    top = max(peaks, key=lambda p: p[0])
    return run.Measurement(top[0], top[1], top[2], 1, [{"kind": "all_gather", "dim": "dp_shard", "phase": "forward",
                                                        "calls": blocks + 2, "bytes": bytes_per_block * blocks}],
                           {"dp_shard": [0, 1]}, None, 100 * blocks, 50 * blocks, 0.0, 0, {"OptState": 7 * blocks},
                           peaks)


def test_each_phase_is_extended_and_the_highest_at_the_depth_is_the_peak():
    """Backward grows 100 per block from 1000, the optimizer step 300 from 500: backward is the peak of 3, 4 and
    5 blocks, the optimizer step from 6 blocks on (at 10: 2600 against 1700)."""
    shallow = [fabricated(n, 1000 + 100 * (n - 3), 500 + 300 * (n - 3)) for n in (3, 4, 5)]
    assert all(m.where.phase == "backward" for m in shallow)
    m = layers.extend(shallow, 3, 10)
    assert (m.peak_bytes, m.by_kind, m.where) == (2600, {"OptState": 2600}, Where("optimizer step", "-", 1))
    assert m.phase_peaks[0] == (1700, {"Activation": 1700}, Where("backward", "layers.9.mlp", 1))
    assert (m.num_params, m.local_param_numel, m.at_optimizer) == (1000, 500, {"OptState": 70})
    assert m.collectives == [{"kind": "all_gather", "dim": "dp_shard", "phase": "forward", "calls": 12, "bytes": 100}]


def test_a_count_off_the_line_or_a_moving_peak_is_not_extended():
    line = [fabricated(n, 1000 + 100 * (n - 3), 600) for n in (3, 4, 5)]
    assert layers.extend(line, 3, 10) is not None
    bent = [*line[:2], fabricated(5, 1000 + 201, 600)]
    assert layers.extend(bent, 3, 10) is None
    moving = [fabricated(n, 1000 + 100 * (n - 3), 600, module=f"layers.{i}.mlp") for i, n in ((1, 3), (1, 4), (3, 5))]
    assert layers.extend(moving, 3, 10) is None  # blocks 1, 1, 3: neither the same block nor the same from the last
    from_last = [fabricated(n, 1000 + 100 * (n - 3), 600, module=f"layers.{n - 3}.mlp") for n in (3, 4, 5)]
    assert layers.extend(from_last, 3, 10).where.module == "layers.7.mlp"  # the third from the last
    first = [fabricated(n, 1000 + 100 * (n - 3), 600, module="layers.0.mlp") for n in (3, 4, 5)]
    assert layers.extend(first, 3, 10).where.module == "layers.0.mlp"
