"""The NGC/EFA version table (cluster/ngc.py): the README shows exactly it, its FP8 columns come from the FP8
recipe table, every value names a source or says "not confirmed", and the image build's check enforces what
our defaults need."""

from __future__ import annotations

import re

import pytest
from slurm_helpers import REPO

from llama_fp8.cluster import ngc
from llama_fp8.precision import recipes


def test_readme_ngc_table_is_current():
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- ngc:start -->\n(.*?)\n<!-- ngc:end -->", text, re.S)
    assert block, "README.md lost its <!-- ngc:start --> ... <!-- ngc:end --> markers"
    assert block.group(1) == ngc.table_markdown(), "run: python -m llama_fp8.cluster.ngc update-readme README.md"


def test_update_readme_rewrites_only_the_block(tmp_path):
    f = tmp_path / "README.md"
    f.write_text("before\n<!-- ngc:start -->\nold\n<!-- ngc:end -->\nafter\n")
    assert ngc.update_readme(f) is True and ngc.update_readme(f) is False
    assert f.read_text() == f"before\n<!-- ngc:start -->\n{ngc.table_markdown()}\n<!-- ngc:end -->\nafter\n"
    (tmp_path / "bad.md").write_text("no markers")
    with pytest.raises(ValueError, match="ngc:start"):
        ngc.update_readme(tmp_path / "bad.md")


def te_rows():
    return [r for r in recipes.all_recipes() if recipes.library_of(r.backend) == "transformer_engine"]


def test_features_follow_the_recipe_tables_minimum_versions():
    """For each TE recipe: a TE just below its min_library lacks it, at min_library has it; FP8 all-gather
    likewise at fp8_all_gather_since. Nothing is hard-coded: the thresholds are the recipe table's."""
    for r in te_rows():
        major, minor, _ = recipes.version_tuple(r.min_library)
        below = f"{major}.{minor - 1}" if minor else f"{major - 1}.99"
        assert r.name not in ngc.te_features(below, "13.0")[0]
        assert r.name in ngc.te_features(r.min_library, "13.0")[0]
        if r.fp8_all_gather_since:
            assert r.name in ngc.te_features(r.fp8_all_gather_since, "13.0")[1]
            major, minor, _ = recipes.version_tuple(r.fp8_all_gather_since)
            assert r.name not in ngc.te_features(f"{major}.{minor - 1}", "13.0")[1]
    assert ngc.te_features(None, "13.0") == ([], [])


def test_features_follow_a_changed_recipe_table(monkeypatch):
    """If the recipe table changes, the README table changes with it (it is computed, not written)."""
    from dataclasses import replace

    rows = te_rows()
    changed = [replace(rows[0], min_library="9.0")] + rows[1:]
    monkeypatch.setattr(ngc, "_te_recipes", lambda: changed)
    assert rows[0].name not in ngc.te_features("2.99", "13.0")[0]
    assert rows[0].name not in ngc.table_markdown().split("\n")[2]


def test_cuda_minimum_of_a_recipe_applies():
    """Block scaling needs CUDA 12.9 on every GPU (the recipe table's (99, 0) row)."""
    needs_cuda = [r for r in te_rows() if any(below >= (99, 0) for below, _ in r.min_cuda)]
    for r in needs_cuda:
        cuda = next(v for below, v in r.min_cuda if below >= (99, 0))
        te = max((x.min_library for x in te_rows()), key=recipes.version_tuple)
        assert r.name in ngc.te_features(te, cuda)[0]
        major, minor, _ = recipes.version_tuple(cuda)
        assert r.name not in ngc.te_features(te, f"{major}.{minor - 1}")[0]


def test_every_cell_names_a_source_or_is_marked():
    for r in ngc.NGC_RELEASES:
        assert ngc.installer(r.efa_installer) is not None, r.tag
        for cell in (r.pytorch, r.cuda, r.nccl, r.transformer_engine, r.min_driver):
            assert cell.source is None or cell.source.startswith(("http", "aws-ofi-nccl")), cell
            assert ("not confirmed" in cell.text()) == (cell.source is None)
    assert ngc.release(ngc.DEFAULT_TAG) is not None
    assert "not confirmed" in ngc.table_markdown()


def test_default_tag_supports_the_default_recipes():
    row = ngc.release(ngc.DEFAULT_TAG)
    names, _ = ngc.te_features(row.transformer_engine.value, row.cuda.value)
    te_default = recipes.default_for(te_rows()[0].backend)
    assert te_default.name in names


def test_check_image_enforces_what_the_defaults_need():
    te_default = recipes.default_for(te_rows()[0].backend)
    ok = {"torch": "2.10.0a0+b4e4ee81d3", "cuda": "13.1", "nccl": "2.28.9", "transformer_engine": te_default.min_library}
    assert ngc.requirement_problems(ok) == []
    major, minor, _ = recipes.version_tuple(te_default.min_library)
    old_te = {**ok, "transformer_engine": f"{major}.{minor - 1}" if minor else f"{major - 1}.9"}
    assert f"needs >= {te_default.min_library}" in ngc.requirement_problems(old_te)[0]
    assert "Transformer Engine missing" in ngc.requirement_problems({**ok, "transformer_engine": None})[0]
    assert "torch 2.5.1" in ngc.requirement_problems({**ok, "torch": "2.5.1"})[0]


def test_check_image_writes_the_image_record(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ngc, "installed_versions", lambda: {"torch": "2.10.0a0+b4e4ee81d3", "cuda": "13.1",
                                                            "nccl": "2.20.5", "transformer_engine": "2.11.0"})
    env = tmp_path / "plugin.env"
    env.write_text("NCCL_NET_PLUGIN_FILE=/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so\n"
                   "NCCL_TUNER_PLUGIN_FILE=/opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so\n")
    out = tmp_path / "image.json"
    assert ngc.main(["check-image", "--tag", "25.12-py3", "--efa", "1.49.0", "--plugin-env", str(env),
                     "--out", str(out)]) == 0
    import json

    record = json.loads(out.read_text())
    assert record["ngc_tag"] == "25.12-py3" and record["efa_installer"] == "1.49.0"
    assert record["NCCL_NET_PLUGIN_FILE"] == "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so"
    printed = capsys.readouterr().out
    assert "ngc.py lists transformer_engine 2.10 for 25.12-py3, the image has 2.11.0" in printed
    assert "NCCL 2.20.5 < 2.21.5 ignores a path in NCCL_NET_PLUGIN" in printed
