"""The A/B arms read one tokenized corpus (cluster/launch/ab_data.py): text is tokenized once, every arm's arguments
name the corpus, and train accepts them; a corpus or synthetic data passes through unchanged."""

from __future__ import annotations

import json
import random

import pytest

from llama_fp8 import config as C
from llama_fp8.cluster.launch import ab_data
from llama_fp8.data import demo as demo_data
from llama_fp8.data import validate_data_config


@pytest.mark.slow  # tokenizes, parses and opens for real (~15 s on a quiet machine)
def test_text_is_tokenized_once_and_every_arm_reads_the_corpus(tmp_path, capsysbinary):
    rng = random.Random(0)
    docs = [" ".join(rng.choice("one two three four five six".split()) for _ in range(rng.randint(3, 30)))
            for _ in range(60)]
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "train.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    tok = demo_data.train_tokenizer(docs, 270, tmp_path / "tok")
    train = ["--model", "tiny", "--dataset", str(tmp_path / "text"), "--tokenizer", str(tok), "--text_field", "body",
             "--val_fraction", "0.1", "--vocab_size", "300", "--max_steps", "3"]
    out = tmp_path / "corpus"
    capsysbinary.readouterr()
    assert ab_data.main(["--out", str(out), "--workers", "1", "--", *train]) == 0
    args = capsysbinary.readouterr().out.decode().split("\0")[:-1]
    assert args == [*train, "--dataset", str(out), "--text_field", "text", "--val_fraction", "0.0"]
    cfg = C.parse_args(args)
    validate_data_config(cfg)  # train takes them: the corpus, its tokenizer, no text flags left
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["text_field"] == "body" and set(manifest["splits"]) == {"train", "validation"}
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert ab_data.arm_args(train, out, 1) == args  # a requeued A/B finds the corpus made
    assert (out / "manifest.json").stat().st_mtime_ns >= stamp
    again = ["--model", "tiny", "--dataset", str(out), "--max_steps", "3"]
    assert ab_data.arm_args(again, tmp_path / "unused", 1) == again and not (tmp_path / "unused").exists()
    assert ab_data.arm_args(["--model", "tiny"], tmp_path / "unused", 1) == ["--model", "tiny"]
    assert ab_data.main(["--out", str(tmp_path / "x"), "--", "--dataset", str(tmp_path / "text")]) == 2
