"""The README states what the code does: its flag table is generated from the config and current."""

from __future__ import annotations

import re

from helpers import REPO
from llama_fp8.config import flag_reference_markdown


def test_readme_flag_table_is_current():
    text = (REPO / "README.md").read_text()
    table = re.search(r"<!-- flags:start -->\n(.*?)\n<!-- flags:end -->", text, re.S)
    assert table, "README.md lost its flag table markers"
    assert table.group(1) == flag_reference_markdown(), "run: python scripts/update_readme_flags.py"


def test_readme_shows_the_two_commands_first():
    text = (REPO / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block
