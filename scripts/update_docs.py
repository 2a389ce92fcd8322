"""Rewrite the generated tables of the docs pages from the code: the flag, FP8 recipe, GPU peak and estimate-term
tables (llama_fp8/reference.py: tests/test_docs.py checks them) and the NGC/EFA image table of docs/cluster.md
(llama_fp8/cluster/ngc.py: tests/cluster/test_ngc.py checks it) and its list of mounted paths
(llama_fp8/cluster/launch/mounts.py: tests/cluster/test_mounts.py checks it). The estimate's per-preset fit table takes real
estimates (about 15 minutes): `nice python scripts/estimate_table.py` rewrites it, tests/estimate/test_table.py says
when it is stale."""

import re
from pathlib import Path

from llama_fp8 import reference
from llama_fp8.cluster import ngc
from llama_fp8.cluster.launch import mounts

repo = Path(__file__).resolve().parents[1]
for rel in reference.FILES:
    path = repo / rel
    text = path.read_text()
    new = reference.render(text)
    path.write_text(new)
    print(rel, "updated" if new != text else "already current")
print("docs/cluster.md (NGC table)", "updated" if ngc.update_readme(repo / "docs" / "cluster.md") else "already current")
cluster_md = repo / "docs" / "cluster.md"
text = cluster_md.read_text()
new = re.sub(r"(<!-- mounted-paths:start -->\n).*?(<!-- mounted-paths:end -->)",
             lambda m: m.group(1) + mounts.paths_markdown() + "\n" + m.group(2), text, flags=re.S)
cluster_md.write_text(new)
print("docs/cluster.md (mounted paths)", "updated" if new != text else "already current")
