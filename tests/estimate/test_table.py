"""docs/estimate.md's "what fits" table (estimate/table.py) is current: its fingerprint is that of today's presets, search
settings, GPU and terms (no estimate runs here), and a change to any of them makes it stale."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import REPO
from llama_fp8 import config
from llama_fp8.estimate import gpus, table, terms


def test_the_estimate_pages_table_is_current_and_lists_every_preset():
    text = (REPO / "docs" / "estimate.md").read_text()
    assert table.stale(text) is None, "run: nice python scripts/estimate_table.py (about 15 minutes)"
    block = text.split(table.MARKERS[0])[1].split(table.MARKERS[1])[0]
    rows = [ln for ln in block.splitlines() if ln.startswith("| ") and not ln.startswith("| preset")]
    assert sorted(r.split("|")[1].strip() for r in rows) == config.available_presets()


@pytest.mark.slow
def test_a_changed_input_makes_the_table_stale(monkeypatch):
    text = table.replace_block(f"x\n{table.MARKERS[0]}\n{table.MARKERS[1]}\n", table.render([], table.fingerprint()))
    assert table.stale(text) is None
    from llama_fp8.config import flags

    real_load = flags.load_preset

    def longer_sequence(name):
        values = real_load(name)
        return {**values, "max_context_width": 2 * values["max_context_width"]} if name == "tiny" else values

    monkeypatch.setattr(flags, "load_preset", longer_sequence)
    assert "other inputs" in table.stale(text)
    monkeypatch.undo()
    monkeypatch.setattr(terms, "ALLOCATOR_MARGIN", 0.1)
    assert "other inputs" in table.stale(text)
    monkeypatch.undo()
    monkeypatch.setitem(gpus.GPUS, "H100", dataclasses.replace(gpus.GPUS["H100"], memory_bytes=80 * 10**9))
    assert "other inputs" in table.stale(text)
    assert "no table" in table.stale("nothing here")


@pytest.mark.slow
def test_a_changed_default_of_the_training_flags_makes_the_table_stale(monkeypatch):
    """The table is made from each preset's whole resolved configuration (the train defaults the presets do not set,
    e.g. the micro-batch, BF16, the sharding), not only from what the preset files hold."""
    from llama_fp8.config import fields, flags

    text = table.replace_block(f"x\n{table.MARKERS[0]}\n{table.MARKERS[1]}\n", table.render([], table.fingerprint()))
    batch = fields.TrainConfig.__dataclass_fields__["train_batch_size"]

    @dataclasses.dataclass(frozen=True)
    class LargerDefaultBatch(fields.TrainConfig):
        train_batch_size: int = dataclasses.field(default=batch.default + 1, metadata=batch.metadata)

    assert config.parse_args(["--model", "llama3.1-8b"]).train_batch_size == batch.default
    monkeypatch.setattr(flags, "TrainConfig", LargerDefaultBatch)
    assert config.parse_args(["--model", "llama3.1-8b"]).train_batch_size == batch.default + 1
    assert "other inputs" in (table.stale(text) or "")


def test_rows_render_as_the_page_shows_them():
    row = {"preset": "p", "params_b": 8.03, "seq": 8192, "batch": 2, "nodes": 2, "ac": "selective",
           "tracked_gib": 60.0, "needed_gib": 61.2, "margin_gib": 3.0, "peak_at": "backward, in the loss"}
    out = table.render([row, {"preset": "q", "nodes": None}], "abc", "torch 9.9")
    assert "Estimated for the Hugging Face model (`--model_impl hf`), with torch 9.9:" in out
    assert "| p | 8.03 B | 8192 x 2 | 2 node(s), 16 GPUs | selective | 61.2 (60.0) + 3.0 | backward, in the loss |" in out
    assert "| q | | | does not fit on 64 nodes" in out and "fingerprint abc" in out


def test_every_presets_defaults_fit_the_nodes_the_fit_table_names():
    """A preset's defaults fit the hardware its docs name: where the fit table (the smallest number of 8 x H100 nodes)
    needs activation checkpointing, the preset checkpoints by default, in a mode every implementation has (the TE
    model, ``auto``'s choice on a GPU node, only has full), so that `--model NAME` alone fits there. Before, the 8B
    preset checkpointed nothing: the README's own command needed over 110 GiB per GPU."""
    from llama_fp8 import models

    text = (REPO / "docs" / "estimate.md").read_text()
    block = text.split(table.MARKERS[0])[1].split(table.MARKERS[1])[0]
    needed = {cells[1].strip(): cells[5].strip() for cells in (ln.split("|") for ln in block.splitlines()
                                                               if ln.startswith("| ") and not ln.startswith("| preset"))}
    everywhere = set.intersection(*({"none", *impl.activation_checkpointing_modes} for impl in models.implementations()))
    assert everywhere == {"none", "full"}
    for preset, ac in needed.items():
        default = config.parse_args(["--model", preset]).activation_checkpointing
        assert default in everywhere, (preset, default)
        assert default == ("none" if ac == "none" else "full"), (preset, ac, default)
