"""docs/reliability.md is the rendered fault matrix: its rows are exactly MATRIX (fault, expected, test),
every row names a test that exists, and the README quotes the doc's headline figures."""

from __future__ import annotations

import re

import matrix

from helpers import REPO

DOC = REPO / "docs" / "reliability.md"
ROW = re.compile(r"^\| (.+?) \| (.+?) \| (.+?) \| (\d+|-) \| `(.+?)` \|$", re.M)


def test_doc_rows_are_the_matrix():
    text = DOC.read_text()
    rows = ROW.findall(text)
    assert sorted((test, fault, expected) for fault, expected, _, _, test in rows) == sorted(
        (k, fault, expected) for k, (_, fault, expected) in matrix.MATRIX.items()), \
        "docs/reliability.md is stale: run the matrix with LLAMA_FP8_RELIABILITY_DOC=docs/reliability.md"
    assert all(observed.strip() for _, _, observed, _, _ in rows)
    assert text.endswith(matrix.DECISIONS.read_text())


def test_every_matrix_row_names_an_existing_test():
    sources = "".join(p.read_text() for p in [*(REPO / "tests" / "reliability").glob("test_*.py"),
                                                REPO / "tests" / "cluster" / "test_faults_slurm.py",
                                                REPO / "tests" / "cluster" / "test_spares_slurm.py"])
    for key, (kind, fault, expected) in matrix.MATRIX.items():
        assert f"def {key.split('[')[0]}(" in sources, key
        assert "|" not in fault + expected and kind in (matrix.FAULT, matrix.BAD_INPUT, matrix.CHANGE)


def test_readme_quotes_the_headline_figures():
    headline = re.search(r"\*\*(\d+ faults injected.*?)\.\*\*", DOC.read_text())
    assert headline, "docs/reliability.md lost its headline"
    readme = REPO / "README.md"
    text = " ".join(readme.read_text().split())
    assert headline.group(1) in text and "(docs/reliability.md)" in text


HOSTILE_ROW = re.compile(r"^\| (.+?) \| (.+?) \| (.+?) \| (.+?) \| `(.+?)` \|$", re.M)


def test_doc_hostile_inputs_are_the_hostile_matrix():
    text = DOC.read_text()
    assert matrix.BEGIN in text and matrix.END in text, "docs/reliability.md lost its hostile-inputs section"
    section = text[text.index(matrix.BEGIN):text.index(matrix.END)]
    rows = HOSTILE_ROW.findall(section)
    assert sorted((test, kind, attack, expected) for kind, attack, expected, _, test in rows) == sorted(
        (k, *v) for k, v in matrix.HOSTILE.items()), \
        "stale: run tests/checkpoint, then .venv/bin/python tests/reliability/matrix.py --hostile_only"
    assert all(observed.strip() for _, _, _, observed, _ in rows)
    sources = "".join(p.read_text() for p in (REPO / "tests" / "checkpoint").glob("test_*.py"))
    assert all(f"def {k.split('[')[0]}(" in sources for k in matrix.HOSTILE)
