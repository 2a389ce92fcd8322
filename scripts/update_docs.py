"""Rewrite the generated tables of the docs pages from the code: the flag, FP8 recipe, GPU peak and estimate-term
tables (llama_fp8/reference.py: tests/test_docs.py checks them) and the NGC/EFA image table of docs/cluster.md
(llama_fp8/cluster/ngc.py: tests/cluster/test_ngc.py checks it). The estimate's per-preset fit table takes real
estimates (about 15 minutes): `nice python scripts/estimate_table.py` rewrites it, tests/estimate/test_table.py says
when it is stale."""

from pathlib import Path

from llama_fp8 import reference
from llama_fp8.cluster import ngc

repo = Path(__file__).resolve().parents[1]
for rel in reference.FILES:
    path = repo / rel
    text = path.read_text()
    new = reference.render(text)
    path.write_text(new)
    print(rel, "updated" if new != text else "already current")
print("docs/cluster.md (NGC table)", "updated" if ngc.update_readme(repo / "docs" / "cluster.md") else "already current")
