"""The tables the docs show that the code already holds (flags, the presets' defaults, FP8 recipes and the formats'
where-it-runs table, GPU peaks, the estimate's terms, the exported gauges), generated so that the docs cannot drift: each sits between ``<!-- NAME:start -->`` and
``<!-- NAME:end -->`` markers in its page (``PAGES``) and ``scripts/update_docs.py`` rewrites them; tests/test_docs.py fails when one is stale or a
page lost its markers."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path


def tables() -> dict[str, Callable[[], str]]:
    from llama_fp8 import config
    from llama_fp8.estimate import terms
    from llama_fp8.precision import recipes
    from llama_fp8.telemetry import gauges, metrics

    return {"flags": config.flag_reference_markdown, "presets": config.preset_table_markdown,
            "recipes": recipes.recipe_table_markdown,
            "formats": recipes.formats_table_markdown,
            "gpu-peaks": metrics.peak_table_markdown, "estimate-terms": terms.terms_table_markdown,
            "gauges": gauges.table_markdown}


PAGES = {"docs/flags.md": ("flags", "presets"), "docs/fp8.md": ("recipes", "formats"), "docs/report.md": ("gpu-peaks",),
         "docs/estimate.md": ("estimate-terms",), "docs/metrics.md": ("gauges",)}
"""Each page and the tables it must hold (a page may hold others too: they are kept current as well)."""
FILES = tuple(PAGES)


def render(text: str) -> str:
    """``text`` with every marked table regenerated."""
    for name, make in tables().items():
        # (?:.*?\n)? also matches an empty block: a table that was never rendered gets rendered.
        text = re.sub(rf"(<!-- {name}:start -->\n)(?:.*?\n)?(<!-- {name}:end -->)",
                      lambda m, make=make: m.group(1) + make() + "\n" + m.group(2), text, flags=re.S)
    return text


def stale(repo: Path) -> list[str]:
    """``file: table`` for every marked table that differs from what the code generates, and
    ``file: table (no markers)`` for a table missing from the page that must hold it."""
    out = []
    for rel in FILES:
        text = (repo / rel).read_text()
        for name, make in tables().items():
            m = re.search(rf"<!-- {name}:start -->\n(?:(.*?)\n)?<!-- {name}:end -->", text, re.S)
            if m is None and name in PAGES[rel]:
                out.append(f"{rel}: {name} (no markers)")
            elif m and (m.group(1) or "") != make():
                out.append(f"{rel}: {name}")
    return out
