"""Tokenized corpora: ``llama_fp8 tokenize`` (local, parallel, resumed), Megatron's .bin/.idx read token for token
(against megatron-core's own writer and reader), hostile files refused naming them, and the global sample order:
resume at 1, 2 and 3 ranks equal in tokens, blends, skip ranges, document boundaries.

CPU only, in-process, no network; a few seconds in all (the corpus is tokenized once per module).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")

from data_cfg import Cfg as DataCfg  # noqa: E402

from llama_fp8 import data  # noqa: E402
from llama_fp8.data import corpus as corpus_mod  # noqa: E402
from llama_fp8.data import demo as demo_data  # noqa: E402
from llama_fp8.data import order  # noqa: E402
from llama_fp8.data import tokenize as tk  # noqa: E402
from llama_fp8.data.indexed import CorpusError, IndexedShard, IndexedWriter  # noqa: E402

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


Cfg = functools.partial(DataCfg, train_batch_size=2, validation_batches=2)


@pytest.fixture(autouse=True)
def _offline_hermetic(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf"))
    datasets.disable_progress_bars()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    rng = random.Random(1)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 90))) for i in range(200)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, docs) -> str:
    return str(demo_data.train_tokenizer(docs, 300, tmp_path_factory.mktemp("tok") / "tokenizer"))


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory, docs) -> Path:
    """train.jsonl (all but 20 documents, one of them empty) and validation.jsonl (the last 20)."""
    root = tmp_path_factory.mktemp("text")
    train = [*docs[:50], "", *docs[50:-20]]
    for name, part in (("train.jsonl", train), ("validation.jsonl", docs[-20:])):
        (root / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    return root


def tokenize(text_dir: Path, tok_dir: str, out: Path, *extra: str) -> int:
    return tk.main(["--dataset", str(text_dir), "--tokenizer", tok_dir, "--out", str(out), "--shard_docs", "48",
                    *extra])


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, text_dir, tok_dir) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "c"
    assert tokenize(text_dir, tok_dir, out) == 0
    return out


def stream_of(texts: list[str], tok_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    return [t for d in texts if d for t in [tok.bos_token_id, *tok(d, add_special_tokens=False)["input_ids"],
                                           tok.eos_token_id]]


def read_all(split) -> np.ndarray:
    out = np.empty(split.n_tokens, np.int64)
    split.read(0, out)
    return out


# ------------------------------------------------------------------------------------------- tokenize
def test_tokenize_writes_every_document_packed_in_order_with_a_manifest(tokenized, docs, tok_dir):
    corpus = corpus_mod.open_corpus(str(tokenized))
    train, val = corpus.splits["train"], corpus.splits["validation"]
    want = stream_of(docs[:-20], tok_dir)
    assert read_all(train).tolist() == want and read_all(val).tolist() == stream_of(docs[-20:], tok_dir)
    assert len(train.shards) == 4 and train.n_docs == 180  # 181 records, the empty one has no document
    lengths = [len(stream_of([d], tok_dir)) for d in docs[:-20]]
    assert train.doc_starts(0, train.n_tokens).tolist() == np.cumsum([0, *lengths[:-1]]).tolist()
    body = json.loads((tokenized / "manifest.json").read_text())
    assert body["splits"]["train"]["tokens"] == len(want) and body["dtype"] == "uint16"
    assert body["tokenizer"]["vocab_size"] == 300 and body["tokenizer"]["name"] == tok_dir
    assert tk.main(["--out", str(tokenized), "--verify"]) == 0


def test_tokenize_in_parallel_tasks_resumes_and_refuses_other_settings(tmp_path, tokenized, text_dir, tok_dir,
                                                                       capsys):
    out = tmp_path / "c"
    assert tokenize(text_dir, tok_dir, out, "--tasks", "2", "--task", "1") == 0
    assert not (out / "manifest.json").exists()  # task 0's shards are missing
    assert sorted(p.name for p in out.glob("*.json")) == ["plan.json", "train-00001.json", "train-00003.json"]
    assert tokenize(text_dir, tok_dir, out, "--tasks", "2", "--task", "0") == 0
    manifest = (out / "manifest.json").read_bytes()
    assert manifest == (tokenized / "manifest.json").read_bytes()  # the same bytes as one process writes
    # interrupted: one shard lost its record (and the manifest was never written); a rerun redoes only that one
    (out / "train-00002.json").unlink()
    (out / "manifest.json").unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("train-0000[013].bin")}
    assert tokenize(text_dir, tok_dir, out, "--workers", "2") == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("train-0000[013].bin")} == kept
    assert (out / "manifest.json").read_bytes() == manifest
    capsys.readouterr()
    assert tokenize(text_dir, tok_dir, out, "--shard_docs", "32") == 2
    err = capsys.readouterr().err
    assert "plan.json: this corpus was started with shard_docs=48, this run has 32" in err, err


# ------------------------------------------------------------------------------------------ Megatron
def megatron():
    try:
        from megatron.core.datasets import indexed_dataset
    except ImportError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but megatron-core does not import ({e}): pip install megatron-core (dev extra)")
        pytest.skip(f"megatron-core is not installed ({e}): pip install --no-deps megatron-core")
    return indexed_dataset


@pytest.mark.slow  # importing megatron.core takes ~20 s here (its package imports its optimizers and models)
def test_megatron_corpora_read_token_for_token_both_ways(tmp_path, tokenized):
    mg = megatron()
    rng = np.random.default_rng(0)
    folder, docs = tmp_path / "mg", {}
    folder.mkdir()
    for name, dtype in (("part-a", np.uint16), ("part-b", np.int32)):
        builder = mg.IndexedDatasetBuilder(str(folder / f"{name}.bin"), dtype=dtype)
        docs[name] = []
        for _ in range(40):  # documents of one or two sequences, as Megatron's sentence splitting writes them
            doc = [torch.from_numpy(rng.integers(0, 300, rng.integers(1, 25))) for _ in range(rng.integers(1, 3))]
            for seq in doc:
                builder.add_item(seq)
            builder.end_document()
            docs[name].append(torch.cat(doc).numpy())
        builder.finalize(str(folder / f"{name}.idx"))
    one = corpus_mod.open_corpus(str(folder / "part-a"))  # a prefix
    assert read_all(one.splits["train"]).tolist() == np.concatenate(docs["part-a"]).tolist()
    both = corpus_mod.open_corpus(str(folder)).splits["train"]  # a folder: its pairs in name order, one stream
    every = [*docs["part-a"], *docs["part-b"]]
    assert read_all(both).tolist() == np.concatenate(every).tolist()
    starts = np.cumsum([0, *map(len, every[:-1])])
    assert both.doc_starts(0, both.n_tokens).tolist() == starts.tolist()
    lo, hi = 300, 700  # a window across the two shards
    assert (both.doc_starts(lo, hi) + lo).tolist() == [s for s in starts if lo <= s < hi]
    # and ours is Megatron's format: megatron-core reads our shards document for document
    theirs = mg.IndexedDataset(str(tokenized / "train-00001"))
    ours = IndexedShard(tokenized / "train-00001")
    assert len(theirs) == ours.n_docs and np.array_equal(np.concatenate([theirs[i] for i in range(len(theirs))]),
                                                         ours.read_tokens(0, ours.n_tokens))


# ------------------------------------------------------------------------------------------ hostile files
def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _set_pointer(idx: Path, i: int, value: int) -> None:
    raw = bytearray(idx.read_bytes())
    n = int.from_bytes(raw[18:26], "little")
    at = 34 + 4 * n + 8 * i
    raw[at:at + 8] = value.to_bytes(8, "little")
    idx.write_bytes(bytes(raw))


def _edit_manifest(root: Path, change) -> None:
    body = json.loads((root / "manifest.json").read_text())
    change(body)
    (root / "manifest.json").write_text(json.dumps(body))


HOSTILE = {
    "truncated .bin": (lambda c: c.joinpath("train-00001.bin").write_bytes(c.joinpath("train-00001.bin").read_bytes()[:-6]),
                       "train-00001.bin: truncated"),
    "index pointing past the end": (lambda c: _set_pointer(c / "train-00002.idx", 47, 10**9),
                                    "train-00002.idx: its last sequence starts at byte 1000000000, past the end"),
    "index header forged": (lambda c: c.joinpath("train-00000.idx").write_bytes(b"MMIDIDX\x00\x00" + bytes(25)),
                            "train-00000.idx:"),
    "forged manifest: token count": (lambda c: _edit_manifest(c, lambda b: b["splits"]["train"]["shards"][0].update(
        tokens=b["splits"]["train"]["shards"][0]["tokens"] + 1)), "manifest.json:"),
    "forged manifest: a name outside the folder": (
        lambda c: _edit_manifest(c, lambda b: b["splits"]["train"]["shards"][0].update(name="../outside")),
        "manifest.json: shard 0 of 'splits.train' needs a plain file name"),
    "forged manifest: a shard linked out of the folder": (
        lambda c: (c / "train-00000.bin").unlink() or (c / "train-00000.bin").symlink_to("/etc/hostname"),
        "manifest.json: 'train-00000.bin' resolves to"),
    "manifest not JSON": (lambda c: c.joinpath("manifest.json").write_text("{"), "manifest.json: not valid JSON"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_corpus_files_are_refused_at_start_naming_the_file(tmp_path, tokenized, case):
    damage, named = HOSTILE[case]
    bad = _copy(tokenized, tmp_path / "bad")
    damage(bad)
    with pytest.raises(CorpusError, match=r"refused") as e:
        data.validate_data_config(Cfg(str(bad)))  # what the run plan calls before anything is built
    assert named in str(e.value) and str(bad) in str(e.value), str(e.value)


def test_an_index_entry_forged_in_the_middle_is_refused_when_a_read_meets_it(tmp_path, tokenized):
    bad = _copy(tokenized, tmp_path / "bad")
    _set_pointer(bad / "train-00002.idx", 20, 12)  # sequence 20 of 48 now points into sequence 0
    split = corpus_mod.open_corpus(str(bad)).splits["train"]  # the O(1) checks at opening pass
    with pytest.raises(CorpusError, match=r"train-00002\.idx: sequence 20 of 48 points at byte 12"):
        split.doc_starts(0, split.n_tokens)
    cfg = Cfg(str(bad), doc_masking=True, train_batch_size=64)
    with pytest.raises(CorpusError, match=r"train-00002\.idx"):  # training with document boundaries stops on it
        next(iter(data.build_train_loader(cfg, 0, 1)))
    with pytest.raises(CorpusError, match=r"train-00002\.idx: its SHA-256 differs from the manifest's"):
        tk.verify(bad)  # the whole check: every byte against the manifest


def test_a_token_outside_the_vocabulary_is_refused_naming_its_file(tmp_path, tokenized):
    with pytest.raises(ValueError, match="300-token tokenizer, more than the model's vocab_size=256"):
        data.validate_data_config(Cfg(str(tokenized), vocab_size=256))
    folder = tmp_path / "mg"
    folder.mkdir()
    writer = IndexedWriter(folder / "x", np.dtype(np.uint16))
    writer.add(np.array([1, 2, 3, 999] * 20), np.array([80]))
    writer.finish()
    with pytest.raises(CorpusError, match=r"x\.bin: token \d+ is 999, outside the model's vocabulary \[0, 512\)"):
        next(iter(data.build_train_loader(Cfg(str(folder)), 0, 1)))


# ---------------------------------------------------------------------------------- the global order
def run_steps(cfg: DataCfg, world: int, steps: int, state: dict | None = None) -> tuple[list, list, dict]:
    """``steps`` steps of ``world`` ranks: per step the combined fingerprint and the sorted rows; rank 0's state."""
    loaders = [data.build_train_loader(cfg, r, world) for r in range(world)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    its = [data.Fingerprinted(loader) for loader in loaders]
    prints, rows = [], []
    for _ in range(steps):
        batches = [next(it) for it in its]
        prints.append(data.combine_fingerprints([it.take() for it in its]))
        rows.append(sorted(tuple(r.tolist()) for b in batches for r in b["input_ids"]))
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states), "every rank holds the same (global) position"
    return prints, rows, states[0]


def test_a_resume_at_1_2_or_3_ranks_reads_exactly_what_the_uninterrupted_run_reads(tokenized):
    cfg = Cfg(str(tokenized), train_batch_size=3)  # global batch 6 = 2 x 3 = 1 x 6 = 3 x 2
    want_prints, want_rows, _ = run_steps(cfg, 2, 8)
    _, _, saved = run_steps(cfg, 2, 4)
    assert saved["position"] == 24 and saved["kind"] == "corpus"  # the data position: one number
    for world, bsz in ((1, 6), (2, 3), (3, 2)):
        prints, rows, state = run_steps(dataclasses.replace(cfg, train_batch_size=bsz), world, 4, saved)
        assert prints == want_prints[4:] and rows == want_rows[4:], (world, bsz)
        assert state["position"] == 48
    assert len({r for step in want_rows for r in step}) == 48  # 48 different samples: a shuffle, not a repeat


def test_another_seed_or_corpus_or_context_is_refused_naming_the_flag(tokenized, tmp_path, text_dir, tok_dir):
    _, _, saved = run_steps(Cfg(str(tokenized)), 1, 2)
    for change, flag in (({"seed": 8}, "--seed"), ({"max_context_width": 16}, "--max_context_width")):
        loader = data.build_train_loader(Cfg(str(tokenized), **change), 0, 1)
        with pytest.raises(data.DataStateError, match=f"saved with {flag}="):
            loader.load_state_dict(saved)
    other = tmp_path / "other"
    assert tokenize(text_dir, tok_dir, other, "--shard_docs", "64") == 0  # the same text, cut otherwise
    with pytest.raises(data.DataStateError, match="saved with --dataset="):
        data.build_train_loader(Cfg(str(other)), 0, 1).load_state_dict(saved)


def write_source(folder: Path, value: int, n_tokens: int) -> str:
    """A Megatron-format corpus whose every token is ``value``: a sample's source is its token."""
    folder.mkdir(parents=True)
    writer = IndexedWriter(folder / "s", np.dtype(np.uint16))
    writer.add(np.full(n_tokens, value), np.array([n_tokens]))
    writer.finish()
    return str(folder)


def test_blend_is_within_one_percent_of_its_weights_over_10000_samples_and_exact_on_resume(tmp_path):
    paths = [write_source(tmp_path / f"s{v}", v, n) for v, n in ((1, 33 * 500), (2, 33 * 300), (3, 33 * 50))]
    blend = f"0.5:{paths[0]},0.3:{paths[1]},0.2:{paths[2]}"
    cfg = Cfg(data_blend=blend, train_batch_size=100)
    data.validate_data_config(cfg)
    loader = data.build_train_loader(cfg, 0, 1)
    it = iter(loader)
    sources = np.concatenate([next(it)["input_ids"][:, 0].numpy() for _ in range(100)])  # 10,000 samples
    share = np.bincount(sources, minlength=4)[1:] / len(sources)
    assert np.abs(share - [0.5, 0.3, 0.2]).max() < 0.01, share
    assert loader.tokens_seen() == {p: int(n) * 32 for p, n in zip(paths, np.bincount(sources)[1:])}
    saved = loader.state_dict()
    more = np.concatenate([next(it)["input_ids"][:, 0].numpy() for _ in range(10)])
    for world, bsz in ((2, 50), (4, 25)):
        resumed = [data.build_train_loader(dataclasses.replace(cfg, train_batch_size=bsz), r, world)
                   for r in range(world)]
        for r in resumed:
            r.load_state_dict(saved)
        its = [iter(r) for r in resumed]
        again = np.concatenate([np.concatenate([next(i)["input_ids"][:, 0].numpy() for i in its])
                                for _ in range(10)])
        assert np.array_equal(again, more), world  # exactly the same sources, in order
    with pytest.raises(ValueError, match="--data_blend and --dataset="):
        data.validate_data_config(Cfg(str(paths[0]), data_blend=blend))
    with pytest.raises(ValueError, match=r"--data_blend='0.5:/x,-1:/y': '-1:/y' is not WEIGHT:PATH"):
        data.validate_data_config(Cfg(data_blend="0.5:/x,-1:/y"))


def test_skip_samples_leave_out_exactly_those_positions_and_stay_in_the_checkpoint(tokenized, caplog):
    cfg = Cfg(str(tokenized), train_batch_size=4)
    order_rows = [r for step in run_steps(cfg, 1, 6)[1] for r in step]  # positions 0..23, each step sorted
    plain = data.build_train_loader(cfg, 0, 1)
    it = iter(plain)
    by_position = [tuple(r.tolist()) for _ in range(6) for r in next(it)["input_ids"]]
    assert sorted(by_position) == sorted(order_rows)
    skipping = data.build_train_loader(dataclasses.replace(cfg, skip_samples="2:5,9:10"), 0, 1)
    it = iter(skipping)
    with caplog.at_level("WARNING"):
        got = [tuple(r.tolist()) for _ in range(4) for r in next(it)["input_ids"]]
    kept = [p for p in range(24) if not (2 <= p < 5 or p == 9)][:16]
    assert got == [by_position[p] for p in kept]
    assert "left out global samples 2..4 (3 samples)" in caplog.text
    state = skipping.state_dict()
    assert state["skip_samples"] == [[2, 5], [9, 10]] and state["position"] == kept[-1] + 1
    # a resume without the flag keeps them; one with another range skips both
    later = data.build_train_loader(dataclasses.replace(cfg, skip_samples="22:23"), 0, 1)
    later.load_state_dict(state)
    assert later.state_dict()["skip_samples"] == [[2, 5], [9, 10], [22, 23]]
    assert [tuple(r.tolist()) for r in next(iter(later))["input_ids"]] == [by_position[p] for p in (20, 21, 23)] + \
        [tuple(r.tolist()) for r in data.build_train_loader(cfg, 0, 1).order.read(np.array([24]), False)[0][:, :-1]]


def test_flags_that_would_do_nothing_with_a_corpus_are_refused(tokenized, text_dir, tok_dir):
    with pytest.raises(ValueError, match=r"--data_files='a.jsonl': how text becomes documents is decided when it is "
                                         r"tokenized"):
        data.validate_data_config(Cfg(str(tokenized), data_files="a.jsonl"))
    with pytest.raises(ValueError, match="--skip_samples 1:2 counts samples of a tokenized corpus"):
        data.validate_data_config(Cfg(str(text_dir), tokenizer=tok_dir, skip_samples="1:2"))
    with pytest.raises(ValueError, match=r"--skip_samples='5:5'.*not A:B with 0 <= A < B"):
        data.validate_data_config(Cfg(str(tokenized), skip_samples="5:5"))
    with pytest.raises(ValueError, match="--doc_masking keeps the documents of real text apart"):
        data.validate_data_config(Cfg(doc_masking=True))
    with pytest.raises(CorpusError, match="tokenized with the tokenizer"):  # a --tokenizer must be the corpus's
        other = demo_data.train_tokenizer(["x y z"] * 20, 280, Path(tok_dir).parent / "other_tok")
        data.validate_data_config(Cfg(str(tokenized), tokenizer=str(other)))
    data.validate_data_config(Cfg(str(tokenized), tokenizer=tok_dir))  # the corpus's own: fine


def test_validation_batches_are_the_validation_split_in_order(tokenized, docs, tok_dir):
    val = data.build_val_loader(Cfg(str(tokenized), val_batch_size=2), 1, 2)  # rank 1 of 2
    stream = stream_of(docs[-20:], tok_dir)
    want = [stream[i * 33:(i + 1) * 33] for i in (2, 3, 6, 7)]
    got = [r.tolist() + [int(b["labels"][k, -1])] for b in val for k, r in enumerate(b["input_ids"])]
    assert len(val) == 2 and got == want


def test_doc_masking_positions_restart_at_each_document_from_the_index_as_after_each_eos(tokenized, text_dir,
                                                                                         tok_dir):
    corpus_batch = next(iter(data.build_train_loader(Cfg(str(tokenized), doc_masking=True, train_batch_size=32), 0, 1)))
    ids, pos, labels = corpus_batch["input_ids"], corpus_batch["position_ids"], corpus_batch["labels"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    starts = (ids == bos) & (torch.arange(32) > 0)  # every document starts with BOS, and only there
    assert torch.equal(pos == 0, starts | (torch.arange(32) == 0)) and int(starts.sum()) > 3
    assert torch.equal(pos[:, 1:] != 0, pos[:, 1:] == pos[:, :-1] + 1)  # counting up inside a document
    crossing = labels == -100
    assert torch.equal(crossing[:, :-1], starts[:, 1:]) and torch.equal(ids[crossing], torch.full_like(ids[crossing], eos))
    # text packed on the fly finds the same boundaries after each EOS
    fly = data.to_batch(torch.cat([ids, labels.clamp(min=0)[:, -1:]], 1).numpy(), eos)
    assert torch.equal(fly["position_ids"][:, 1:], pos[:, 1:])


def test_the_permutation_is_a_seeded_bijection_and_the_blend_even(tokenized):
    for n in (1, 2, 3, 7, 100, 4097):
        perm = order.Permutation(n, (7, 0, 0))(np.arange(n))
        assert sorted(perm.tolist()) == list(range(n))
    a, b = order.Permutation(1000, (7, 0, 0)), order.Permutation(1000, (7, 0, 1))
    assert not np.array_equal(a(np.arange(1000)), b(np.arange(1000)))  # another epoch, another order
    blend = order.Blend([0.7, 0.3])
    assert blend.shares == [7, 3] and blend.pattern.tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]
    src, _ = blend.locate(np.arange(1, 101))
    counts = np.cumsum(np.eye(2, dtype=int)[src], 0)
    assert np.abs(counts[:, 1] - 0.3 * np.arange(2, 102)).max() <= 1  # within one sample at every prefix
    assert order.parse_skips("9:10,2:5,4:6") == [(2, 6), (9, 10)]


def test_the_fingerprint_of_a_step_is_its_rows_crcs_whoever_read_them(tokenized):
    cfg = Cfg(str(tokenized), train_batch_size=4)
    batch = next(iter(data.build_train_loader(cfg, 0, 1)))
    want = sum(zlib.crc32(r.numpy()) for r in batch["input_ids"]) % 2**32
    two = [data.Fingerprinted(data.build_train_loader(dataclasses.replace(cfg, train_batch_size=2), r, 2))
           for r in range(2)]
    for f in two:
        next(f)
    assert data.combine_fingerprints([f.take() for f in two]) == f"{want:08x}"


def test_threads_reading_ahead_give_the_same_batches_and_position(tokenized):
    cfg = Cfg(str(tokenized), train_batch_size=4, doc_masking=True)
    plain, ahead = data.build_train_loader(cfg, 0, 1), data.build_train_loader(dataclasses.replace(cfg, num_workers=2),
                                                                              0, 1)
    a, b = iter(plain), iter(ahead)
    for _ in range(5):
        x, y = next(a), next(b)
        assert all(torch.equal(x[k], y[k]) for k in ("input_ids", "labels", "position_ids"))
    # the threads have read further ahead; the position counts only the batches handed out
    assert ahead.state_dict() == plain.state_dict() and ahead.state_dict()["position"] == 20
