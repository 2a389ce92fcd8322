"""Rewrite the generated tables of README.md and docs/fp8.md from the code (llama_fp8/reference.py);
tests/test_docs.py checks that they are current."""

from pathlib import Path

from llama_fp8 import reference

repo = Path(__file__).resolve().parents[1]
for rel in reference.FILES:
    path = repo / rel
    text = path.read_text()
    new = reference.render(text)
    path.write_text(new)
    print(rel, "updated" if new != text else "already current")
