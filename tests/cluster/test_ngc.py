"""The NGC/EFA version table (cluster/ngc.py): docs/cluster.md shows exactly it, its FP8 columns come from the FP8
recipe table, every value names a source or says "not confirmed", and the image build's check enforces what
our defaults need."""

from __future__ import annotations

import re

import pytest
from slurm_helpers import REPO

from llama_fp8.cluster import ngc
from llama_fp8.precision import recipes


def test_the_cluster_page_ngc_table_is_current():
    text = (REPO / "docs" / "cluster.md").read_text()
    block = re.search(r"<!-- ngc:start -->\n(.*?)\n<!-- ngc:end -->", text, re.S)
    assert block, "docs/cluster.md lost its <!-- ngc:start --> ... <!-- ngc:end --> markers"
    assert block.group(1) == ngc.table_markdown(), "run: python scripts/update_docs.py"


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
    """If the recipe table changes, the page's table changes with it (it is computed, not written)."""
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
    """A value either names the page it comes from (shown as [n], listed under the table with its address) or is
    marked "not confirmed"; a value we could not find at all is printed as such, never guessed."""
    table = ngc.table_markdown()
    for r in ngc.NGC_RELEASES:
        assert ngc.installer(r.efa_installer) is not None, r.tag
        for name, cell in [*r.cells().items(), ("arm64", r.arm64)]:
            assert cell.source is None or cell.source.url.startswith("https://"), (r.tag, name, cell)
            assert ("not confirmed" in cell.text()) == (cell.source is None), (r.tag, name)
            if cell.source:
                assert f"{cell.source.url}" in table
    assert ngc.release(ngc.DEFAULT_TAG) is not None
    assert "not confirmed" in table
    listed = re.findall(r"^(\d+)\. .*: (https://\S+)$", table, flags=re.M)
    assert [int(n) for n, _ in listed] == list(range(1, len(listed) + 1)), "sources are numbered 1..n"
    for number, url in listed:  # each [n] in the table points at the source with that number
        users = [c for r in ngc.NGC_RELEASES for c in (*r.cells().values(), r.arm64) if c.source and c.source.url == url]
        users += [e.ofi_nccl for e in ngc.EFA_INSTALLERS if e.ofi_nccl.source and e.ofi_nccl.source.url == url]
        assert users and all(f"{c.value} [{number}]" in table for c in users), url


def test_third_party_sources_are_labelled():
    """Versions read from someone else's file (not NVIDIA's or AWS's page) say so in the table."""
    table = ngc.table_markdown()
    third = {c.source for r in ngc.NGC_RELEASES for c in r.cells().values() if c.source and c.source.third_party}
    assert third, "the 26.xx rows come from public Dockerfiles that list their NGC base's versions"
    for source in third:
        line = next(ln for ln in table.splitlines() if ln.endswith(source.url))
        assert "(third-party)" in line and "github.com" in source.url


def test_default_row_has_its_versions_sourced():
    """The default moves only onto a release whose PyTorch, CUDA, cuDNN, NCCL, Transformer Engine and driver
    were found (Python is recorded by the image build: check-image)."""
    row = ngc.release(ngc.DEFAULT_TAG)
    for name in ("torch", "cuda", "cudnn", "nccl", "transformer_engine", "min_driver"):
        cell = row.cells()[name]
        assert cell.value and cell.source, (name, cell)


def test_default_is_the_newest_row_our_te_code_supports():
    """Every TE recipe, and its FP8 all-gather, at the recipe table's minimum versions holds on the default's TE;
    no newer row exists that would also qualify."""
    row = ngc.release(ngc.DEFAULT_TAG)
    names, gather = ngc.te_features(row.transformer_engine.value, row.cuda.value)
    assert names == [r.name for r in te_rows()]
    assert gather == [r.name for r in te_rows() if r.fp8_all_gather_since]
    later = ngc.NGC_RELEASES[ngc.NGC_RELEASES.index(row) + 1:]
    assert not [r.tag for r in later if r.transformer_engine.source], "a newer sourced row: move the default"


def test_default_efa_installer_names_the_default_nccl_exactly():
    """The pair is consistent: the default installer's aws-ofi-nccl release was tested with exactly the NCCL
    of the default NGC release, and check-image agrees (no note)."""
    row = ngc.release(ngc.DEFAULT_TAG)
    efa = ngc.installer(row.efa_installer)
    assert row.nccl.value in efa.nccl_tested
    assert ngc.efa_problem(row.nccl.value, row.efa_installer) == ""
    assert efa.ofi_nccl.source is not None, "the default installer's plugin version is confirmed"


def test_every_row_pairs_with_an_installer_of_its_nccl_minor():
    for r in ngc.NGC_RELEASES:
        e = ngc.installer(r.efa_installer)
        minors = {recipes.version_tuple(v)[:2] for v in e.nccl_tested}
        assert recipes.version_tuple(r.nccl.value)[:2] in minors, (r.tag, r.nccl.value, e.version)


def test_efa_problem_names_a_mismatched_or_unknown_installer():
    assert "tested with NCCL 2.28.9, 2.29.7, 2.30.4; the image has NCCL 2.31.2" in ngc.efa_problem("2.31.2", "1.49.0")
    assert "not confirmed" in ngc.efa_problem("2.31.2", "1.51.0")
    assert "1.99.0 is not in" in ngc.efa_problem("2.31.2", "1.99.0")
    assert ngc.efa_problem(None, "1.50.0") == ""


@pytest.mark.parametrize("found, listed, same", [
    ("13.4", "13.4.1", True), ("13.1", "13.1.0", True), ("9.24.0", "9.24.0.43", True),
    ("2.14.0a0+b2c75dd062.nv26.09", "2.14.0a0+b2c75dd062", True), ("2.19.0+4220403e", "2.19.0", True),
    ("2.10", "2.1", False), ("2.20.0", "2.19.0", False), ("2.14.0a0+0000000000", "2.14.0a0+b2c75dd062", False),
    ("3.12.3", "3.12", True), ("13", "13.4", False)])
def test_same_version_compares_to_the_precision_both_give(found, listed, same):
    assert ngc.same_version(found, listed) is same


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
    monkeypatch.setattr(ngc, "installed_versions", lambda: {
        "torch": "2.14.0a0+b2c75dd062.nv26.09", "cuda": "13.4", "cudnn": "9.26.0", "nccl": "2.20.5",
        "transformer_engine": "2.20.0", "python": "3.12.3"})
    env = tmp_path / "plugin.env"
    env.write_text("NCCL_NET_PLUGIN_FILE=/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so\n"
                   "NCCL_TUNER_PLUGIN_FILE=/opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so\n")
    out = tmp_path / "image.json"
    assert ngc.main(["check-image", "--tag", "26.09-py3", "--efa", "1.50.0", "--plugin-env", str(env),
                     "--out", str(out)]) == 0
    import json

    record = json.loads(out.read_text())
    assert record["ngc_tag"] == "26.09-py3" and record["efa_installer"] == "1.50.0"
    assert record["cudnn"] == "9.26.0" and record["python"] == "3.12.3"
    assert record["NCCL_NET_PLUGIN_FILE"] == "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so"
    printed = capsys.readouterr().out
    assert "ngc.py lists transformer_engine 2.19.0 for 26.09-py3, the image has 2.20.0" in printed
    assert "ngc.py lists nccl 2.31.2 for 26.09-py3, the image has 2.20.5" in printed
    assert "lists torch" not in printed and "lists cuda" not in printed and "lists cudnn" not in printed
    assert "EFA installer 1.50.0 installs aws-ofi-nccl 1.21.1, tested with NCCL 2.31.2; the image has NCCL 2.20.5" \
        in printed
    assert "NCCL 2.20.5 < 2.21.5 ignores a path in NCCL_NET_PLUGIN" in printed


def test_check_image_on_the_default_pair_prints_no_note(monkeypatch, capsys):
    """An image whose versions are the default row's: nothing to update, the EFA pair fits."""
    row = ngc.release(ngc.DEFAULT_TAG)
    found = {"torch": row.pytorch.value + ".nv26.09", "cuda": "13.4", "cudnn": row.cudnn.value,
             "nccl": row.nccl.value, "transformer_engine": row.transformer_engine.value + "+abcdef0", "python": "3.12.3"}
    monkeypatch.setattr(ngc, "installed_versions", lambda: found)
    assert ngc.main(["check-image", "--tag", row.tag, "--efa", row.efa_installer]) == 0
    assert "note:" not in capsys.readouterr().out


def test_check_image_on_the_stand_in_base_records_it_and_compares_nothing(tmp_path, monkeypatch, capsys):
    """The tests' stand-in base (scripts/container/standin/) has CPU torch and only a record of TE: its build
    says so, compares nothing with the NGC row (no "update the row" advice) and records base "stand-in", which
    the A/B report shows instead of an NGC tag; the requirements still apply."""
    import json

    row = ngc.release(ngc.DEFAULT_TAG)
    marker = tmp_path / "standin-base"
    marker.write_text("torch 2.13.0+cpu (CPU), Transformer Engine record 2.19.0: the image tests stand-in\n")
    monkeypatch.setattr(ngc, "STANDIN_MARKER", marker)
    found = {"torch": "2.13.0+cpu", "cuda": None, "cudnn": None, "nccl": None,
             "transformer_engine": row.transformer_engine.value, "python": "3.11.2"}
    monkeypatch.setattr(ngc, "installed_versions", lambda: found)
    out = tmp_path / "image.json"
    assert ngc.main(["check-image", "--tag", row.tag, "--efa", row.efa_installer, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"stand-in for NGC {row.tag}: torch 2.13.0+cpu" in printed
    assert "the tests' stand-in base (torch 2.13.0+cpu (CPU)" in printed and "update the row" not in printed
    assert json.loads(out.read_text())["base"] == "stand-in"
    monkeypatch.setattr(ngc, "installed_versions", lambda: {**found, "transformer_engine": None})
    assert ngc.main(["check-image", "--tag", row.tag, "--efa", row.efa_installer]) == 1

    from llama_fp8.report import hardware

    text = hardware._image({"image": "/x/llama-fp8.sqsh", "image_build": json.loads(out.read_text())})
    assert f"stand-in for NGC {row.tag} (tests)" in text


def test_cudnn_version_number_is_read_as_major_minor_patch():
    assert ngc._cudnn_text(92600) == "9.26.0" and ngc._cudnn_text(92401) == "9.24.1" and ngc._cudnn_text(None) is None


@pytest.mark.parametrize("tag", [r.tag for r in ngc.NGC_RELEASES if r.transformer_engine.value])
def test_every_fp8_all_gather_the_table_offers_is_one_training_accepts(tag):
    """The table's "TE FP8 all-gather" column is what `--fp8_all_gather 1` with the TE model accepts: it showed
    `block` while training refuses block + FP8 all-gather on every TE version."""
    from llama_fp8 import config
    from llama_fp8.models.te.fp8.precision import check_fp8_parameters

    row = ngc.release(tag)
    by_name = {r.name: r for r in te_rows()}
    for name in ngc.te_features(row.transformer_engine.value, row.cuda.value)[1]:
        cfg = config.parse_args(["--model", "tiny", "--fp8", "1", "--fp8_backend", "te", "--fp8_recipe", name,
                                 "--fp8_all_gather", "1"])
        check_fp8_parameters(cfg, by_name[name])
