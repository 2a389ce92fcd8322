"""The demo's real-text corpus and tokenizer, built locally from the Python standard library.

Text source: the docstrings of the standard library's own ``.py`` files (found through
``sysconfig``; test suites excluded) plus the language-reference topics of ``pydoc_data.topics``.
Both ship with every CPython, so no network is needed. Documents: one per module docstring and per
top-level class or function (a class's document includes its methods' docstrings), and one per
pydoc topic. About 5% of the documents (chosen by a CRC of their name) form the validation split.

Layout written into ``out_dir`` (idempotent: rebuilt only when the stamp does not match):
``corpus/train.jsonl``, ``corpus/validation.jsonl`` (records ``{"text": ...}``; the folder is a valid
``--dataset``), ``tokenizer/`` (byte-level BPE from ``tokenizers``, saved with ``save_pretrained``,
BOS ``<s>``, EOS ``</s>``, PAD ``<pad>``), ``stamp.json``.

CLI: ``python -m llama_fp8.data.demo OUT_DIR [--vocab_size N]`` prints the --dataset/--tokenizer flags.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import sys
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1
DEFAULT_VOCAB_SIZE = 4096
MIN_DOC_CHARS = 80
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "lib2to3", "turtledemo"}
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")


@dataclass(frozen=True)
class DemoData:
    """Paths of a prepared demo corpus and tokenizer."""

    dataset_dir: Path
    tokenizer_dir: Path
    n_train_docs: int
    n_val_docs: int


def _docstrings(node: ast.AST) -> Iterator[str]:
    for child in ast.walk(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            doc = ast.get_docstring(child)
            if doc:
                yield doc


def module_documents(path: Path, name: str) -> Iterator[tuple[str, str]]:
    """(key, text) documents of one source file: module docstring, each top-level class/function."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    doc = ast.get_docstring(tree)
    if doc:
        yield name, doc
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = "\n\n".join(_docstrings(node))
            if text:
                yield f"{name}.{node.name}", text


def stdlib_sources(max_files: int | None = None) -> list[tuple[Path, str]]:
    """Sorted (path, module name) of the standard library's .py files, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        out.append((path, ".".join(rel.with_suffix("").parts)))
    return out[:max_files] if max_files is not None else out


def corpus_documents(max_files: int | None = None) -> list[tuple[str, str]]:
    """All (key, text) documents of the demo corpus, in a fixed order."""
    docs = [d for path, name in stdlib_sources(max_files) for d in module_documents(path, name)]
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; docstrings alone still work
        topics = {}
    docs += [(f"pydoc.{k}", topics[k]) for k in sorted(topics)][: max_files]
    return [(k, t.strip()) for k, t in docs if len(t.strip()) >= MIN_DOC_CHARS]


def is_validation(key: str) -> bool:
    """About 1 in 20 documents, fixed by name (stable across runs and machines)."""
    return zlib.crc32(key.encode()) % 20 == 0


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> Path:
    """Train a byte-level BPE on ``texts`` and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos, eos, pad = SPECIAL_TOKENS
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                            pad_token=pad).save_pretrained(str(out_dir))
    return out_dir


def _write_jsonl(path: Path, texts: list[str]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def prepare_demo_data(out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE,
                      max_files: int | None = None) -> DemoData:
    """Create (or reuse) the demo corpus and tokenizer under ``out_dir``."""
    out = Path(out_dir)
    stamp = {"version": FORMAT_VERSION, "vocab_size": vocab_size, "max_files": max_files,
             "python": sys.version.split()[0]}
    stamp_path = out / "stamp.json"
    if stamp_path.exists():
        saved = json.loads(stamp_path.read_text())
        if {k: saved.get(k) for k in stamp} == stamp:
            return DemoData(out / "corpus", out / "tokenizer", saved["n_train"], saved["n_val"])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "corpus").mkdir(parents=True)
    docs = corpus_documents(max_files)
    train = [t for k, t in docs if not is_validation(k)]
    val = [t for k, t in docs if is_validation(k)]
    _write_jsonl(tmp / "corpus" / "train.jsonl", train)
    _write_jsonl(tmp / "corpus" / "validation.jsonl", val)
    train_tokenizer(train, vocab_size, tmp / "tokenizer")
    (tmp / "stamp.json").write_text(json.dumps({**stamp, "n_train": len(train), "n_val": len(val)}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # the stamp appears only with complete contents
    return DemoData(out / "corpus", out / "tokenizer", len(train), len(val))


def main(argv: list[str] | None = None) -> int:
    """CLI: build the demo data and print the flags that train on it."""
    parser = argparse.ArgumentParser(prog="python -m llama_fp8.data.demo", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--vocab_size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args(argv)
    data = prepare_demo_data(args.out_dir, args.vocab_size)
    print(f"--dataset={data.dataset_dir} --tokenizer={data.tokenizer_dir}  "
          f"# {data.n_train_docs} train / {data.n_val_docs} validation documents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
