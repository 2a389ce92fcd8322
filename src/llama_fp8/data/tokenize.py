"""``llama_fp8 tokenize``: text (local files or a hub dataset, the sources ``--dataset`` reads) into a tokenized corpus
that every training run then reads without tokenizing (docs/data.md: tokenize once, train many times).

    python -m llama_fp8 tokenize --dataset /fsx/raw --tokenizer /fsx/tok --out /fsx/corpus --workers 8
    sbatch --array=0-63 scripts/slurm/tokenize.sbatch --dataset /fsx/raw --tokenizer /fsx/tok --out /fsx/corpus

The documents of each split (train; validation when the source has one or --val_fraction holds one out) are cut into
shards of --shard_docs documents in stored order; shard k is ``{split}-{k:05d}.bin/.idx`` (``indexed.py``: Megatron's
format), each document ``[BOS] tokens [EOS]``. Array task i of n (Slurm's SLURM_ARRAY_TASK_ID and _COUNT, or --task
and --tasks) takes the shards k with k % n == i; locally, --workers processes share them the same way.

Resumable: a shard is done when its record ``{split}-{k:05d}.json`` (counts, sizes, SHA-256s) is written, after its
files; a rerun skips done shards and redoes the rest. ``plan.json``, written by the first task, fixes the layout: a
rerun with other settings into the same --out is refused naming the setting. The task that finds every shard done
writes ``manifest.json`` (``manifest.py``), the same bytes whichever task it is: the corpus exists from then on.
A streamed hub dataset (--streaming 1) has no known length: one task reads it in order (its shards resume as well).
``--verify`` checks a finished corpus byte for byte against its manifest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from llama_fp8.data import manifest as mf
from llama_fp8.data.corpus import open_corpus
from llama_fp8.data.indexed import IndexedWriter, token_dtype
from llama_fp8.data.packing import Encoder
from llama_fp8.data.sources import SourceKey, open_sources
from llama_fp8.data.tokenizer import check_tokenizer, load_tokenizer, tokenizer_sha256
from llama_fp8.errors import EXIT_BAD_CONFIG, ConfigError

log = logging.getLogger("llama_fp8.tokenize")
PLAN = "plan.json"
PLAN_FORMAT = "llama-fp8 tokenize plan"
READ_DOCS = 1024  # documents per batched tokenizer call


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama-fp8 tokenize", description=__doc__.split("\n")[0],
                                epilog="docs: docs/data.md")
    p.add_argument("--out", required=True, help="the corpus folder to write (on the shared file system)")
    p.add_argument("--dataset", help="local file/folder or hub dataset, as for train --dataset")
    p.add_argument("--tokenizer", help="local folder or hub id for AutoTokenizer")
    p.add_argument("--dataset_config_name", default=None, help="hub dataset config (e.g. en for allenai/c4)")
    p.add_argument("--text_field", default="text", help="name of the text column")
    p.add_argument("--data_files", default=None, help="comma-separated files or globs inside --dataset")
    p.add_argument("--val_data_files", default=None, help="comma-separated validation files or globs")
    p.add_argument("--val_fraction", type=float, default=0.0, help="fraction of local documents held out for "
                   "validation when there is no validation split (the same documents train's --val_fraction holds out)")
    p.add_argument("--streaming", type=int, choices=(0, 1), default=0, help="1: stream a hub dataset (one task)")
    p.add_argument("--shard_docs", type=int, default=200_000, help="documents per shard")
    p.add_argument("--task", type=int, default=None, help="this task's index (default: the Slurm array's)")
    p.add_argument("--tasks", type=int, default=None, help="how many tasks share the work (default: the array's)")
    p.add_argument("--workers", type=int, default=1, help="local processes sharing this task's shards")
    p.add_argument("--verify", action="store_true", help="only check --out byte for byte against its manifest")
    return p


def task_of(args: argparse.Namespace) -> tuple[int, int]:
    """(this task's index, number of tasks): the flags, else Slurm's array variables, else (0, 1)."""
    env = os.environ
    tasks = args.tasks if args.tasks is not None else int(env.get("SLURM_ARRAY_TASK_COUNT", "1"))
    task = args.task if args.task is not None else (int(env.get("SLURM_ARRAY_TASK_ID", "0")) -
                                                    int(env.get("SLURM_ARRAY_TASK_MIN", "0")))
    if tasks < 1 or not 0 <= task < tasks:
        raise ConfigError(f"--task {task} of --tasks {tasks}: the index must be in [0, tasks)")
    return task, tasks


# ------------------------------------------------------------------------------------------ the plan
def make_plan(args: argparse.Namespace) -> dict:
    """What this corpus is made of and how it is cut; every task computes it and must agree with ``plan.json``."""
    if not args.dataset or not args.tokenizer:
        raise ConfigError("llama_fp8 tokenize needs --dataset and --tokenizer (and --out)")
    if args.shard_docs < 1 or args.workers < 1:
        raise ConfigError(f"--shard_docs {args.shard_docs} and --workers {args.workers} must be >= 1")
    tok = load_tokenizer(args.tokenizer)
    check_tokenizer(tok, args.tokenizer, None)
    src = open_sources(_key(args))
    splits = {"train": src.n_docs("train")}
    if src.val is not None:
        splits["validation"] = src.n_docs("validation")
    return {"format": PLAN_FORMAT, "version": 1, "shard_docs": args.shard_docs,
            "dtype": token_dtype(len(tok)).name,
            "source": {k: getattr(_key(args), k) for k in ("dataset", "config_name", "text_field", "data_files",
                                                             "val_data_files", "val_fraction", "streaming")},
            "tokenizer": {"name": args.tokenizer, "sha256": tokenizer_sha256(tok), "vocab_size": len(tok),
                          "bos_id": tok.bos_token_id, "eos_id": tok.eos_token_id},
            "splits": splits}


def _key(args: argparse.Namespace) -> SourceKey:
    return SourceKey(args.dataset, args.dataset_config_name, args.text_field, args.data_files, args.val_data_files,
                     float(args.val_fraction), bool(args.streaming))


def agree_on_plan(out: Path, plan: dict) -> None:
    """Write ``plan.json`` if no task did yet (exclusively); else it must be this plan."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / PLAN
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(plan, f, indent=1, sort_keys=True)
        return
    except FileExistsError:
        pass
    try:
        saved = json.loads(path.read_text()[:1 << 20])
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot be read ({e}); remove it to start the corpus over") from None
    for key in ("shard_docs", "dtype", "source", "tokenizer", "splits"):
        if saved.get(key) != plan[key]:
            raise ConfigError(f"{path}: this corpus was started with {key}={saved.get(key)!r}, this run has "
                              f"{plan[key]!r}; rerun with the same settings, or give another --out")


def shard_names(plan: dict) -> list[tuple[str, int]]:
    """(split, k) of every shard of a known-length plan."""
    return [(split, k) for split, n in plan["splits"].items() for k in range(max(1, -(-n // plan["shard_docs"])))]


# ------------------------------------------------------------------------------------------ one shard
def _record_path(out: Path, split: str, k: int) -> Path:
    return out / f"{split}-{k:05d}.json"


def done_record(out: Path, split: str, k: int) -> dict | None:
    """The shard's record if it is done and its files are still the ones recorded, else None."""
    path = _record_path(out, split, k)
    try:
        rec = json.loads(path.read_text()[:1 << 16])
        ok = all((out / f"{rec['name']}{s}").stat().st_size == rec[key]
                 for s, key in ((".bin", "bin_bytes"), (".idx", "idx_bytes")))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return rec if ok else None


def _texts(args: argparse.Namespace, split: str, lo: int, hi: int):
    """The texts of documents [lo, hi) of a split, a batch at a time."""
    src = open_sources(_key(args))
    ds, ids = (src.train, src.train_ids) if split == "train" else (src.val, src.val_ids)
    ds = ds.select_columns([args.text_field])
    for a in range(lo, hi, READ_DOCS):
        b = min(a + READ_DOCS, hi)
        yield ds[ids[a:b] if ids is not None else range(a, b)][args.text_field]


def write_shard(args: argparse.Namespace, plan: dict, split: str, k: int, texts) -> dict:
    """Tokenize ``texts`` (batches of strings) into shard k of ``split`` and record it."""
    out, name = Path(args.out), f"{split}-{k:05d}"
    encode, t0 = Encoder(load_tokenizer(args.tokenizer)), time.perf_counter()
    writer = IndexedWriter(out / name, np.dtype(plan["dtype"]))
    for batch in texts:
        stream, lengths = encode.documents(batch)
        writer.add(stream, lengths)
    rec = {"name": name, **writer.finish()}
    tmp = _record_path(out, split, k).with_suffix(f".json.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(rec, sort_keys=True))
    os.replace(tmp, _record_path(out, split, k))
    log.info("%s: %d documents, %d tokens (%.0f tokens/s)", name, rec["documents"], rec["tokens"],
             rec["tokens"] / max(time.perf_counter() - t0, 1e-9))
    return rec


def _one(args: argparse.Namespace, plan: dict, split: str, k: int) -> str:
    if done_record(Path(args.out), split, k) is not None:
        return f"{split}-{k:05d}: done before"
    lo = k * plan["shard_docs"]
    hi = min(lo + plan["shard_docs"], plan["splits"][split])
    write_shard(args, plan, split, k, _texts(args, split, lo, hi))
    return f"{split}-{k:05d}: written"


# ------------------------------------------------------------------------------------------ the job
def run(args: argparse.Namespace) -> bool:
    """This task's shards, then the manifest if every shard is done; True if the corpus is complete."""
    out = Path(args.out)
    plan = make_plan(args)
    agree_on_plan(out, plan)
    task, tasks = task_of(args)
    if any(n is None for n in plan["splits"].values()):
        if tasks > 1:
            raise ConfigError(f"--streaming 1: a stream has no known length to split into {tasks} tasks; run one task "
                              f"(or --streaming 0 to download it and split it)")
        return _run_stream(args, plan)
    mine = [s for i, s in enumerate(shard_names(plan)) if i % tasks == task]
    log.info("task %d of %d: %d of %d shards", task, tasks, len(mine), len(shard_names(plan)))
    if args.workers > 1 and len(mine) > 1:
        with ProcessPoolExecutor(min(args.workers, len(mine))) as pool:
            for done in [pool.submit(_one, args, plan, s, k) for s, k in mine]:
                log.info("%s", done.result())
    else:
        for s, k in mine:
            log.info("%s", _one(args, plan, s, k))
    return finalize(out, plan, {split: -(-n // plan["shard_docs"]) or 1 for split, n in plan["splits"].items()})


def _run_stream(args: argparse.Namespace, plan: dict) -> bool:
    """A stream in order, one shard per --shard_docs documents; done shards are skipped (read past) on a rerun."""
    out, n_shards = Path(args.out), {}
    src = open_sources(_key(args))
    for split in plan["splits"]:
        ds = (src.train if split == "train" else src.val).select_columns([args.text_field])
        batches = ds.iter(batch_size=READ_DOCS)
        per_shard = -(-plan["shard_docs"] // READ_DOCS)
        k, exhausted = 0, False
        while not exhausted:
            chunk = []
            for _ in range(per_shard):
                batch = next(batches, None)
                if batch is None:
                    exhausted = True
                    break
                chunk.append(batch[args.text_field])
            if chunk or k == 0:
                if done_record(out, split, k) is None:
                    write_shard(args, plan, split, k, chunk)
                k += 1
        n_shards[split] = k
    return finalize(out, plan, n_shards)


def finalize(out: Path, plan: dict, n_shards: dict[str, int]) -> bool:
    """Write the manifest once every shard is done (by whichever task finds that; the same bytes from each)."""
    splits = {}
    for split, n in n_shards.items():
        records = [done_record(out, split, k) for k in range(n)]
        if any(r is None for r in records):
            log.info("%s: %d of %d shards done; the task that finishes the last writes the manifest", split,
                     sum(r is not None for r in records), n)
            return False
        splits[split] = {"documents": sum(r["documents"] for r in records),
                         "tokens": sum(r["tokens"] for r in records), "shards": records}
    body = {"format": mf.FORMAT, "version": mf.VERSION, "dtype": plan["dtype"], "tokenizer": plan["tokenizer"],
            "source": plan["source"], "splits": splits}
    mf.write_manifest(out, body)
    log.info("corpus complete: %s", open_corpus.__wrapped__(str(out)).describe())
    return True


def verify(out: Path) -> None:
    corpus = open_corpus.__wrapped__(str(out))
    body, _ = mf.read_manifest(out)
    for name, split in body["splits"].items():
        for shard, rec in zip(corpus.splits[name].shards, split["shards"]):
            shard.verify(rec["bin_sha256"], rec["idx_sha256"])
    print(f"verified: {corpus.describe()}: every byte matches {out / mf.MANIFEST}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # worker processes: one tokenizer thread each
    args = build_parser().parse_args(argv)
    try:
        if args.verify:
            verify(Path(args.out))
            return 0
        run(args)
        return 0
    except (ConfigError, ValueError) as e:  # CorpusError is a ConfigError; a bad source is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
