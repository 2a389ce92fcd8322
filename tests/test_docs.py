"""The docs state what the code does: their tables (flags, FP8 recipes, GPU peaks) are generated from the
code and current."""

from __future__ import annotations

from helpers import REPO
from llama_fp8 import reference


def test_generated_tables_are_current():
    assert reference.stale(REPO) == [], "run: python scripts/update_docs.py"
    readme, fp8 = (REPO / "README.md").read_text(), (REPO / "docs" / "fp8.md").read_text()
    for marker in ("<!-- flags:start -->", "<!-- recipes:start -->", "<!-- gpu-peaks:start -->"):
        assert marker in readme, f"README.md lost {marker}"
    assert "<!-- recipes:start -->" in fp8


def test_a_stale_table_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- recipes:start -->\n| old |\n<!-- recipes:end -->\n")
    (tmp_path / "docs" / "fp8.md").write_text(reference.render("<!-- recipes:start -->\nx\n<!-- recipes:end -->"))
    assert reference.stale(tmp_path) == ["README.md: recipes"]


def test_readme_shows_the_two_commands_first():
    text = (REPO / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block
