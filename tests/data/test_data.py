"""Data pipeline: local formats, packing, disjoint ranks, exact resume, validation, errors, synthetic.

CPU only, no network (hub access is forced offline), a few seconds per test.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import re
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")

from data_cfg import Cfg  # noqa: E402

from llama_fp8 import data  # noqa: E402
from llama_fp8.data import demo as demo_data  # noqa: E402
from llama_fp8.data import packing, readers  # noqa: E402
from llama_fp8.data import sources as data_sources  # noqa: E402
from llama_fp8.data import tokenizer as data_tokenizer  # noqa: E402

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega the of and to in is that for it as with").split()


def make_docs(n: int, seed: int = 0) -> list[str]:
    """Unique documents of varied length (5..150 words), each starting with its number."""
    rng = random.Random(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 150)))
            for i in range(n)]


@pytest.fixture(autouse=True)
def _offline_hermetic(tmp_path_factory, monkeypatch):
    """No network, and the arrow cache of local files inside pytest's tmp dir."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf"))
    datasets.disable_progress_bars()


@pytest.fixture(scope="session")
def docs() -> list[str]:
    return make_docs(240)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory, docs) -> str:
    return str(demo_data.train_tokenizer(docs, 400, tmp_path_factory.mktemp("tok") / "tokenizer"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, docs) -> Path:
    """Folder with train.jsonl (all but 20 docs) and validation.jsonl (the last 20)."""
    root = tmp_path_factory.mktemp("corpus")
    for name, part in (("train.jsonl", docs[:-20]), ("validation.jsonl", docs[-20:])):
        (root / name).write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(part)))
    return root


def take(loader, n: int) -> list[dict[str, torch.Tensor]]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def rows(batches) -> set[tuple[int, ...]]:
    return {tuple(r.tolist()) for b in batches for r in torch.cat([b["input_ids"], b["labels"][:, -1:]], 1)}


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])


# ------------------------------------------------------------------------------------- packing
def test_pack_documents_matches_naive_concatenation():
    lists = [[5, 6, 7], [], [8], [9, 10]]
    naive = [t for ids in lists for t in [1, *ids, 2]]
    assert packing.pack_documents(lists, 1, 2).tolist() == naive
    assert packing.pack_documents(lists, None, 2).tolist() == [t for ids in lists for t in [*ids, 2]]
    assert packing.pack_documents([], 1, 2).tolist() == []


def test_unshuffled_blocks_are_the_document_stream_cut_into_t_plus_1(corpus, tok_dir, docs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    stream = [t for d in docs[:-20] for t in [tok.bos_token_id, *tok(d, add_special_tokens=False)["input_ids"],
                                            tok.eos_token_id]]
    src = data_sources.open_sources(data_sources.SourceKey(str(corpus), None, "text", None, None, 0.0, True))
    reader = readers.MapDocReader(src.train, None, "text", 0, 1, 0, shuffle=False, chunk_docs=16)
    spec = packing.PackSpec(seq_len=32, batch_size=4, seed=0, shuffle=False, cycle=False)
    blocks = np.concatenate([b for b, _ in packing.packed_batches(reader, packing.Encoder(tok), spec, 0, None)])
    assert blocks.shape[1] == 33 and len(blocks) == len(stream) // 33 // 4 * 4
    assert blocks.reshape(-1).tolist() == stream[: blocks.size]


def test_batches_have_shifted_labels_and_valid_ids(corpus, tok_dir):
    batch = take(data.build_train_loader(Cfg(str(corpus), tokenizer=tok_dir), 0, 1), 1)[0]
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert 0 <= int(batch["input_ids"].min()) and int(batch["input_ids"].max()) < 400


# ------------------------------------------------------------------------------- local formats
def write_formats(root: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents as .txt, .jsonl, .json, .parquet, .arrow and a save_to_disk folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"text": docs})
    paths = {k: root / f"docs.{k}" for k in ("txt", "jsonl", "json", "parquet", "arrow")}
    paths["txt"].write_text("\n".join(docs) + "\n")
    paths["jsonl"].write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    paths["json"].write_text(json.dumps([{"text": d} for d in docs]))
    pq.write_table(table, paths["parquet"])
    with pa.ipc.new_stream(str(paths["arrow"]), table.schema) as writer:
        writer.write_table(table)
    paths["save_to_disk"] = root / "saved"
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(paths["save_to_disk"]))
    return paths


def test_all_local_formats_give_the_same_batches(tmp_path, tok_dir, docs):
    results = {fmt: take(data.build_train_loader(Cfg(str(p), tokenizer=tok_dir), 0, 1), 2)
               for fmt, p in write_formats(tmp_path, docs[:60]).items()}
    for fmt, batches in results.items():
        assert_same(batches, results["jsonl"]), fmt


def test_data_files_globs_inside_a_folder(tmp_path, tok_dir, docs):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "part1.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:30]))
    (tmp_path / "a" / "part2.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[30:60]))
    cfg = Cfg(str(tmp_path), data_files="a/*.jsonl", tokenizer=tok_dir)
    data.validate_data_config(cfg)
    assert len(data_sources.open_sources(data_sources.SourceKey.from_cfg(cfg)).train) == 60


# ---------------------------------------------------------------------------- ranks and resume
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ranks_never_share_a_block_or_a_document(corpus, tok_dir, num_workers):
    cfg = Cfg(str(corpus), tokenizer=tok_dir, num_workers=num_workers, max_context_width=64)
    tok = data_tokenizer.load_tokenizer(tok_dir)
    per_rank = [take(data.build_train_loader(cfg, r, 2), 40) for r in (0, 1)]
    assert not rows(per_rank[0]) & rows(per_rank[1])
    numbers = [{int(n) for b in batches for r in b["input_ids"] for n in re.findall(r"doc (\d+):", tok.decode(r))}
               for batches in per_rank]
    assert min(map(len, numbers)) > 80  # 40 batches cover an epoch of each rank's 110 documents
    assert not numbers[0] & numbers[1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_yields_exactly_the_uninterrupted_batches(corpus, tok_dir, num_workers):
    cfg = Cfg(str(corpus), tokenizer=tok_dir, num_workers=num_workers, max_context_width=64)
    full = take(data.build_train_loader(cfg, 1, 2), 30)  # > 1 epoch of this rank's documents
    first = data.build_train_loader(cfg, 1, 2)
    it = iter(first)
    for _ in range(5):  # odd, so the resumed loader must start at the second worker
        next(it)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    resumed = data.build_train_loader(cfg, 1, 2)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert_same(take(resumed, 25), full[5:])


def test_resume_rejects_a_different_layout(corpus, tok_dir):
    loader = data.build_train_loader(Cfg(str(corpus), tokenizer=tok_dir), 0, 1)
    take(loader, 1)
    other = data.build_train_loader(Cfg(str(corpus), tokenizer=tok_dir, num_workers=1), 0, 1)
    with pytest.raises(ValueError, match="num_workers"):
        other.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="kind"):
        data.build_train_loader(Cfg(), 0, 1).load_state_dict(loader.state_dict())


def test_streaming_reader_is_disjoint_and_resumes_exactly(tmp_path, tok_dir, docs):
    files = []
    for k in range(4):  # 4 shards: split_dataset_by_node assigns whole files to the 2 slots
        files.append(str(tmp_path / f"s{k}.jsonl"))
        Path(files[-1]).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[k * 40:(k + 1) * 40]))
    stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    encode = packing.Encoder(data_tokenizer.load_tokenizer(tok_dir))
    spec = packing.PackSpec(seq_len=32, batch_size=4, seed=3, shuffle=True)

    def run(slot: int, state=None, n: int = 40):
        reader = readers.StreamDocReader(stream, "text", slot, 2, chunk_docs=8)
        gen = packing.packed_batches(reader, encode, spec, slot, state)
        return [next(gen) for _ in range(n)]

    full = run(0)  # crosses an epoch boundary of this slot's 80 documents
    resumed = run(0, full[9][1], 30)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(full[10:], resumed, strict=True))
    other = run(1, n=10)
    assert not {tuple(r) for b, _ in full[:10] for r in b} & {tuple(r) for b, _ in other for r in b}


def test_hub_streaming_path_with_a_local_stand_in(tmp_path, tok_dir, docs, monkeypatch):
    """The hub code path (streaming, `validation` split, workers, resume) with local files behind it."""
    files = []
    for k in range(4):
        files.append(str(tmp_path / f"train-{k}.jsonl"))
        Path(files[-1]).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[k * 50:(k + 1) * 50]))
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[200:]))
    real_load = datasets.load_dataset

    def fake_hub(name, config_name=None, **kwargs):
        assert name == "owner/corpus" and config_name == "en" and kwargs["streaming"]
        return real_load("json", data_files={"train": files, "validation": [str(tmp_path / "val.jsonl")]},
                         streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    cfg = Cfg("owner/corpus", dataset_config_name="en", tokenizer=tok_dir, num_workers=2)
    full = take(data.build_train_loader(cfg, 1, 2), 14)
    first = data.build_train_loader(cfg, 1, 2)
    take(first, 5)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    resumed = data.build_train_loader(cfg, 1, 2)
    resumed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert_same(take(resumed, 9), full[5:])
    assert not rows(full) & rows(take(data.build_train_loader(cfg, 0, 2), 14))
    assert len(list(data.build_val_loader(cfg, 1, 2))) == 3


def test_hub_dataset_with_streaming_off_is_opened_map_style(tmp_path, tok_dir, docs, monkeypatch):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:100]))
    real_load, seen = datasets.load_dataset, []

    def fake_hub(name, config_name=None, **kwargs):
        seen.append(kwargs["streaming"])
        return real_load("json", data_files={"train": str(path)}, streaming=kwargs["streaming"])

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    cfg = Cfg("owner/map-style", tokenizer=tok_dir, streaming=False)
    assert len(take(data.build_train_loader(cfg, 0, 1), 3)) == 3
    assert seen and set(seen) == {False}
    # Downloaded whole: random access, so an exact per-epoch shuffle (streaming reads in stored order).
    assert len(data_sources.open_sources(data_sources.SourceKey.from_cfg(cfg)).train) == 100


def test_hub_dataset_with_val_data_files_only(tmp_path, tok_dir, docs, monkeypatch):
    """A hub --dataset + --val_data_files, no --data_files: train from the hub, validation from the files."""
    parts = {"train": docs[:150], "hub_val": docs[150:200], "val": docs[200:]}
    for name, part in parts.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    val_file = str(tmp_path / "val.jsonl")
    real_load = datasets.load_dataset

    def fake_hub(name, config_name=None, **kwargs):
        assert name == "owner/corpus" and config_name == "en" and kwargs["streaming"]
        if "data_files" in kwargs:  # the --val_data_files call
            assert kwargs["data_files"] == [val_file] and kwargs["split"] == "train"
            return real_load("json", data_files=kwargs["data_files"], split="train", streaming=True)
        return real_load("json", data_files={"train": str(tmp_path / "train.jsonl"),
                                             "validation": str(tmp_path / "hub_val.jsonl")}, streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    cfg = Cfg("owner/corpus", dataset_config_name="en", tokenizer=tok_dir, val_data_files=f" {val_file} ,")
    val = list(data.build_val_loader(cfg, 0, 1))
    monkeypatch.setattr(datasets, "load_dataset", real_load)
    alone = list(data.build_val_loader(Cfg(val_file, val_data_files=val_file, tokenizer=tok_dir), 0, 1))
    assert len(val) == 3
    assert_same(val, alone)  # not the hub's own validation split
    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    train = take(data.build_train_loader(cfg, 0, 1), 10)
    assert not rows(train) & rows(val)
    tok = data_tokenizer.load_tokenizer(tok_dir)

    def doc_numbers(batches) -> set[int]:
        return {int(n) for b in batches for r in b["input_ids"] for n in re.findall(r"doc (\d+):", tok.decode(r))}

    train_docs, val_docs = doc_numbers(train), doc_numbers(val)
    assert train_docs and max(train_docs) < 150   # the hub's train split
    assert val_docs and min(val_docs) >= 200      # the --val_data_files documents


# ---------------------------------------------------------------------------------- validation
def test_validation_split_from_folder_is_fixed_and_equal_per_rank(corpus, tok_dir):
    cfg = Cfg(str(corpus), tokenizer=tok_dir, validation_batches=5)
    v0, v1 = data.build_val_loader(cfg, 0, 2), data.build_val_loader(cfg, 1, 2)
    a, b = list(v0), list(v0)
    assert len(a) == len(list(v1)) == len(v0) == 5
    assert_same(a, b)  # re-iterable, same batches every evaluation
    assert not rows(a) & rows(take(data.build_train_loader(cfg, 0, 1), 20))


def test_val_fraction_holds_out_documents(tmp_path, tok_dir, docs):
    path = tmp_path / "all.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    src = data_sources.open_sources(data_sources.SourceKey(str(path), None, "text", None, None, 0.1, True))
    assert len(src.val_ids) == 24 and len(src.train_ids) == 216
    assert not set(src.val_ids.tolist()) & set(src.train_ids.tolist())
    assert data.build_val_loader(Cfg(str(path), tokenizer=tok_dir, val_fraction=0.1), 0, 1) is not None
    assert data.build_val_loader(Cfg(str(path), tokenizer=tok_dir), 0, 1) is None


def test_val_data_files(tmp_path, corpus, tok_dir):
    cfg = Cfg(str(corpus / "train.jsonl"), val_data_files=str(corpus / "validation.jsonl"), tokenizer=tok_dir)
    assert len(list(data.build_val_loader(cfg, 0, 1))) == 3


# ------------------------------------------------------------------------------------- errors
def test_error_messages(tmp_path, corpus, tok_dir, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # a hub id without the Hub: a setting, exit 2
    no_eos = tmp_path / "no_eos"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.eos_token = None
    tok.save_pretrained(str(no_eos))
    cases = [
        (Cfg(str(tmp_path / "missing.jsonl"), tokenizer=tok_dir), "no such file"),
        (Cfg(str(corpus), data_files="nope/*.jsonl", tokenizer=tok_dir), "--data_files.*matches no data file"),
        (Cfg("no-such-owner/no-such-dataset", tokenizer=tok_dir), "neither a local path nor a loadable"),
        (Cfg(str(corpus), text_field="content", tokenizer=tok_dir), "--text_field='content'.*columns"),
        (Cfg(str(corpus)), "needs --tokenizer"),
        (Cfg(str(corpus), tokenizer=str(tmp_path / "no_tok")), "--tokenizer=.*no such directory"),
        (Cfg(str(corpus), tokenizer=str(no_eos)), "defines no EOS token"),
        (Cfg(str(corpus), tokenizer=tok_dir, vocab_size=100), "more than the model's vocab_size=100"),
        (Cfg(str(corpus), tokenizer=tok_dir, val_fraction=1.5), "--val_fraction"),
    ]
    for cfg, message in cases:
        with pytest.raises(ValueError, match=message):
            data.validate_data_config(cfg)


def test_missing_train_split_is_reported(tmp_path, tok_dir, docs):
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": docs[:10]})}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="no 'train' split; splits: \\['validation'\\]"):
        data.validate_data_config(Cfg(str(tmp_path / "dd"), tokenizer=tok_dir))


def test_too_few_documents_for_the_reader_slots(tmp_path, tok_dir, docs):
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:3]))
    with pytest.raises(ValueError, match="3 training documents, fewer than"):
        data.validate_data_config(Cfg(str(path), tokenizer=tok_dir, num_workers=2), dp_world=2)


# ---------------------------------------------------------------------------------- synthetic
def test_synthetic_is_deterministic_world_size_independent_and_learnable():
    world1 = take(data.build_train_loader(Cfg(train_batch_size=4), 0, 1), 3)
    world2 = [take(data.build_train_loader(Cfg(train_batch_size=2), r, 2), 3) for r in (0, 1)]
    for step in range(3):
        assert torch.equal(world1[step]["input_ids"],
                           torch.cat([world2[0][step]["input_ids"], world2[1][step]["input_ids"]]))
    assert_same(world1, take(data.build_train_loader(Cfg(train_batch_size=4), 0, 1), 3))
    x = world1[0]["input_ids"]
    assert torch.equal(x[:, 1:], world1[0]["labels"][:, :-1])
    stride = (x[:, 1:] - x[:, :-1]) % 256
    assert torch.all(stride == stride[:, :1]) and int(x.max()) < 256  # x_t = (a + b t) mod 256
    assert not torch.equal(x, take(data.build_train_loader(Cfg(seed=8), 0, 1), 1)[0]["input_ids"])


def test_synthetic_resume_and_validation():
    loader = data.build_train_loader(Cfg(), 0, 1)
    full = take(loader, 5)
    resumed = data.build_train_loader(Cfg(), 0, 1)
    resumed.load_state_dict({"version": 1, "kind": "synthetic", "step": 2})
    assert_same(take(resumed, 3), full[2:])
    val = data.build_val_loader(Cfg(), 0, 1)
    assert len(list(val)) == 3 and not rows(list(val)) & rows(full)


def test_fingerprint_passes_batches_through_and_changes_with_them(corpus, tok_dir):
    cfg = Cfg(str(corpus), tokenizer=tok_dir)
    plain = take(data.build_train_loader(cfg, 0, 1), 4)
    fp = data.Fingerprinted(data.build_train_loader(cfg, 0, 1))
    assert_same(plain, take(fp, 4))
    again = data.Fingerprinted(data.build_train_loader(cfg, 0, 1))
    next(again), next(again)
    first = again.take()
    next(again), next(again)
    assert first != again.take() and again.take() == 0  # a new window after each take()
    other = data.Fingerprinted(data.build_train_loader(dataclasses.replace(cfg, seed=8), 0, 1))
    next(other), next(other)
    assert other.take() != first
    # the window's fingerprint is the sum of its rows' CRC32s: the same samples give it whatever rank read them
    rows_crc = [zlib.crc32(r.numpy()) for b in take(data.build_train_loader(cfg, 0, 1), 2) for r in b["input_ids"]]
    assert first == sum(rows_crc) % 2**32
    assert data.combine_fingerprints([first]) == f"{first:08x}"
    assert data.combine_fingerprints([5, 7, 5, 7], readers_per_batch=2) == f"{12:08x}"  # a TP group counts once


# ---------------------------------------------------------------------------------- demo data
def test_demo_data_is_real_text_cached_and_loadable(tmp_path):
    demo = demo_data.prepare_demo_data(tmp_path / "demo", vocab_size=300, max_files=25)
    stamp = (tmp_path / "demo" / "stamp.json").stat().st_mtime_ns
    again = demo_data.prepare_demo_data(tmp_path / "demo", vocab_size=300, max_files=25)
    assert again == demo and (tmp_path / "demo" / "stamp.json").stat().st_mtime_ns == stamp
    first = json.loads((demo.dataset_dir / "train.jsonl").read_text().splitlines()[0])["text"]
    assert len(first) >= demo_data.MIN_DOC_CHARS and " the " in (demo.dataset_dir / "train.jsonl").read_text()
    cfg = Cfg(str(demo.dataset_dir), tokenizer=str(demo.tokenizer_dir), vocab_size=300)
    data.validate_data_config(cfg)
    assert take(data.build_train_loader(cfg, 0, 1), 1)[0]["input_ids"].shape == (4, 32)
