"""Rewrite the flag table in README.md from the config dataclass (tests/test_docs.py checks it)."""

import re
from pathlib import Path

from llama_fp8.config import flag_reference_markdown

readme = Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
new = re.sub(r"(<!-- flags:start -->\n).*?(<!-- flags:end -->)",
             lambda m: m.group(1) + flag_reference_markdown() + "\n" + m.group(2), text, flags=re.S)
readme.write_text(new)
print("README.md flag table", "updated" if new != text else "already current")
