"""docs/estimate.md shows a report as the command prints it: the command is run here and its report must be the
page's, line for line (all but the line with the time the estimate took and the library versions). One 8B estimate
on fake tensors: slow (about 15 CPU seconds)."""

from __future__ import annotations

import shlex

import pytest

from helpers import REPO

pytestmark = pytest.mark.slow


def stable(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.strip().splitlines() if not ln.startswith("Estimated in ")]


def test_the_estimate_pages_example_is_what_its_command_prints(capsys):
    from llama_fp8.estimate import cli

    page = (REPO / "docs" / "estimate.md").read_text()
    block = page.split("$ python -m llama_fp8 estimate ", 1)[1].split("```", 1)[0]
    argv, shown = block.split("\n", 1)
    assert cli.main(shlex.split(argv)) == 0
    assert stable(capsys.readouterr().out) == stable(shown), "the page's example is stale: paste the command's report"
