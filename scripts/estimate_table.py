"""Rewrite docs/estimate.md's "what fits" table from the estimator (llama_fp8/estimate/table.py): for every preset, the
smallest number of 8-GPU H100 nodes and the activation checkpointing that fit. Each row takes several estimates
(26 estimates, 14 minutes for all presets on 2 shared cores; run it with `nice`). Progress on stderr, one JSON line per row on
stdout; tests/estimate/test_table.py says when the table is stale.

    python scripts/estimate_table.py [--presets tiny,llama3.2-1b]   # default: every preset
"""

import argparse
import json
import logging
import sys
import time
from pathlib import Path

repo = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(repo / "src"))

from llama_fp8 import config  # noqa: E402
from llama_fp8.estimate import table  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--presets", default=",".join(config.available_presets()))
args = parser.parse_args()
logging.basicConfig(level=logging.ERROR)
start = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - start:7.0f} s] {msg}", file=sys.stderr, flush=True)


page = repo / "docs" / "estimate.md"
rows = []
for preset in args.presets.split(","):
    rows.append(table.search(preset, say))
    print(json.dumps(rows[-1]), flush=True)
if set(args.presets.split(",")) != set(config.available_presets()):
    say("not every preset: docs/estimate.md left as it is")
    sys.exit(0)
order = {name: i for i, name in enumerate(config.available_presets())}
rows.sort(key=lambda r: (r["params_b"] if r.get("nodes") else 1e9, order[r["preset"]]))
old = page.read_text()  # read now: the search takes minutes
new = table.replace_block(old, table.render(rows, table.fingerprint()))
page.write_text(new)
say("docs/estimate.md " + ("updated" if new != old else "already current"))
