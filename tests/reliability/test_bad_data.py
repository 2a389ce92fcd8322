"""Bad data files under a real training start (1 rank, in-process): an error naming the file and line
at start-up (malformed or unreadable data), or a counted, logged skip (empty files, documents without
text) - the policy in docs/reliability.md."""

from __future__ import annotations

import json
import os

import datasets
import pytest
from faultkit import SMALL, run1

from helpers import train_records
from llama_fp8.data import demo as demo_data

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    return str(demo_data.prepare_demo_data(tmp_path_factory.mktemp("demo"), vocab_size=300,
                                           max_files=10).tokenizer_dir)


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Corpus:
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    return Corpus(tmp_path / "corpus")


class Corpus:
    """Two good JSONL files of 30 documents each; tests add a bad one."""

    def __init__(self, root):
        self.root = root
        root.mkdir()
        for name in ("a", "b"):
            self.write(f"{name}.jsonl", [json.dumps({"text": doc(name, i)}) for i in range(30)])

    def write(self, name: str, lines: list[str] | bytes):
        path = self.root / name
        path.write_bytes(lines if isinstance(lines, bytes) else "".join(ln + "\n" for ln in lines).encode())
        return path


def doc(name: str, i: int) -> str:
    return f"Document {i} of file {name}: " + " ".join(f"word{(i * 7 + k) % 50}" for k in range(60))


def train(corpus, tokenizer_dir, tmp_path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = run1(tmp_path / "run", [*SMALL, "--max_steps", "2", "--dataset", str(corpus.root), "--tokenizer",
                                 tokenizer_dir, "--vocab_size", "320", "--num_workers", "0"])
    return rc, capsys.readouterr().err


def good(i: int) -> str:
    return json.dumps({"text": doc("c", i)})


BAD = {
    "malformed JSON line": (lambda c: c.write("c.jsonl", [good(0), good(1), '{"text": "no closing quote}', good(3)]),
                            "c.jsonl line 3: not valid JSON"),
    "files with different fields": (lambda c: c.write("c.jsonl", [good(0), json.dumps({"text": "x", "id": 1})]),
                                    "c.jsonl has the fields ['id', 'text']"),
    "invalid UTF-8": (lambda c: c.write("c.jsonl", (good(0) + "\n" + good(1) + "\n").encode() + b'{"text": "\xff\xfe"}\n'),
                      "c.jsonl line 3: not valid UTF-8"),
    "dangling symlink": (lambda c: os.symlink(c.root / "gone.jsonl", c.root / "c.jsonl"),
                         "c.jsonl: cannot be read"),
    "every file empty": (lambda c: [c.write(n, b"") for n in ("a.jsonl", "b.jsonl")], "every data file is empty"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_data_is_refused_naming_file_and_line(corpus, tokenizer_dir, tmp_path, capsys, row, bad):
    make, want = BAD[bad]
    make(corpus)
    rc, err = train(corpus, tokenizer_dir, tmp_path, capsys)
    assert rc == 2, err[-3000:]
    line = next((ln for ln in err.splitlines() if "llama-fp8 train: error" in ln), "")
    assert want in line and str(corpus.root) in line, err[-3000:]
    assert "Traceback" not in err
    message = line.split("): ", 1)[-1].replace(str(corpus.root) + "/", "")
    row(f"exit 2 at start-up: \"{message[:200]}\"", None)


@pytest.mark.slow
def test_empty_file_is_skipped_and_counted(corpus, tokenizer_dir, tmp_path, capsys, row):
    corpus.write("c.jsonl", b"")
    rc, err = train(corpus, tokenizer_dir, tmp_path, capsys)
    assert rc == 0, err[-3000:]
    warn = next(ln for ln in err.splitlines() if "empty" in ln and "WARNING" in ln)
    assert "1 of 3 data files" in warn and "c.jsonl" in warn, warn
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 2]
    row(f"trained; warning: \"{warn.split(': ', 2)[-1].replace(str(corpus.root) + '/', '')[:200]}\"", None)


def test_documents_without_text_are_skipped_and_counted(corpus, tokenizer_dir, tmp_path, capsys, row):
    corpus.write("c.jsonl", [good(0), "{}", json.dumps({"text": None}), good(3)])
    rc, err = train(corpus, tokenizer_dir, tmp_path, capsys)
    assert rc == 0, err[-3000:]
    warn = next(ln for ln in err.splitlines() if "no 'text'" in ln)
    assert "2 of 64 training documents" in warn, warn
    assert [r["step"] for r in train_records(tmp_path / "run")] == [1, 2]
    row(f"trained; warning: \"{warn.split(': ', 2)[-1][:200]}\"", None)
