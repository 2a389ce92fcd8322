"""Data pipeline throughput on local real text: a tokenized corpus against tokenizing on the fly, and the
on-the-fly pipeline against the common one-document-at-a-time recipe; and the corpus reader's memory as the corpus
grows.

Corpus and tokenizer: the demo's (``llama_fp8.data.demo``: Python stdlib docstrings, 4096-token
byte-level BPE), built once into --work_dir, and tokenized once there (``llama_fp8 tokenize``; its time is
reported). Measured in one run:

- baseline: iterate the ``datasets`` rows one by one, ``tokenizer(text)`` per document, append to a
  Python list, slice (B, T+1) batches off the list (what common FSDP examples do), one process;
- pipeline (in-process): ``build_train_loader`` on the text with --num_workers=0 (one tokenizer thread);
- pipeline: ``build_train_loader`` on the text with 1 worker and with --num_workers workers (today's path);
- corpus: ``build_train_loader`` on the tokenized corpus (the global shuffled order, samples read from the
  memory-mapped shards), in-process and with --num_workers threads reading ahead.

Each is timed for --seconds after its first batch (worker start-up excluded, reported separately)
and --warmup untimed seconds (a training run reads for hours: steady state is what matters),
once per round in a rotated order, for --rounds rounds. Reported: the median and best tokens/s of
each (one data-parallel rank's loader: tokens/s per rank), and two ratios, each the median of the ratios within a
round (the machine may be shared: a busy spell then slows both sides of a ratio): corpus in-process / pipeline with
--num_workers workers (target >= 10x) and pipeline / baseline. Also reported: CPU seconds per million tokens
including workers (how much cheaper per CPU second, whatever the load).

Memory: the corpus repeated to --memory_tokens tokens and to 10x that (shards of the same tokens), each read for
--memory_batches batches in a fresh process (documents' boundaries included, as --doc_masking reads them); the
reader's resident memory after opening and after reading, above the process's before opening. Prints a table, then
one JSON line. Run: ``PYTHONPATH=src python benchmarks/bench_data.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llama_fp8 import data
from llama_fp8.data import demo as demo_data
from llama_fp8.data import manifest as mf
from llama_fp8.data import packing
from llama_fp8.data import tokenize as tokenize_cmd
from llama_fp8.data import tokenizer as data_tokenizer
from llama_fp8.data.corpus import open_corpus
from llama_fp8.data.indexed import IndexedWriter


@dataclass
class Cfg:
    """The data fields of the training config."""

    dataset: str
    tokenizer: str
    max_context_width: int
    train_batch_size: int
    num_workers: int
    seed: int = 0
    dataset_config_name: str | None = None
    text_field: str = "text"
    data_files: str | None = None
    val_data_files: str | None = None
    val_fraction: float = 0.0
    val_batch_size: int = 1
    vocab_size: int = demo_data.DEFAULT_VOCAB_SIZE
    validation_batches: int = 1
    streaming: bool = True
    data_blend: str | None = None
    skip_samples: str | None = None
    doc_masking: bool = False


def baseline_batches(cfg: Cfg) -> Iterator[torch.Tensor]:
    """The common recipe: one tokenizer call per document, ``buffer = buffer + ids``, one sample
    of T+1 tokens sliced off the list at a time and B samples stacked into a batch."""
    import datasets

    tok = data_tokenizer.load_tokenizer(cfg.tokenizer)
    ds = datasets.load_dataset("json", data_files=str(Path(cfg.dataset) / "train.jsonl"), split="train")
    width, samples = cfg.max_context_width + 1, []
    buffer: list[int] = []
    while True:
        for example in ds:
            ids = tok(example["text"], add_special_tokens=False)["input_ids"]
            buffer = buffer + [tok.bos_token_id] + ids + [tok.eos_token_id]
            while len(buffer) >= width:
                samples.append(torch.tensor(buffer[:width]))
                buffer = buffer[width:]
                if len(samples) == cfg.train_batch_size:
                    yield torch.stack(samples)
                    samples = []


def same_tokens(cfg: Cfg, n_docs: int = 64) -> bool:
    """Both sides do the same work: the pipeline's batched encoder turns the first documents into
    exactly the stream the baseline builds one document at a time."""
    import datasets

    tok = data_tokenizer.load_tokenizer(cfg.tokenizer)
    ds = datasets.load_dataset("json", data_files=str(Path(cfg.dataset) / "train.jsonl"), split="train")
    texts = [t for t in ds.select(range(min(n_docs, len(ds))))["text"] if t]
    one_by_one: list[int] = []
    for text in texts:
        one_by_one = one_by_one + [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"] + [
            tok.eos_token_id]
    return packing.Encoder(tok)(texts).tolist() == one_by_one


def _cpu_seconds() -> float:
    """User+system CPU of this process and of its exited (joined) children, e.g. DataLoader workers."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def measure(make: Callable[[], Iterator], seconds: float, tokens_per_batch: int, warmup: float) -> dict:
    """Steady-state tokens/s over ``seconds``, after the first batch (start-up, reported on its own)
    and ``warmup`` more seconds (the tokenizer's word cache fills); CPU seconds per million tokens
    over the whole run including workers (robust to a busy machine)."""
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    it = make()
    next(it)
    startup = time.perf_counter() - t0
    warm, t1 = 0, time.perf_counter()
    while time.perf_counter() - t1 < warmup:
        next(it)
        warm += 1
    n, t1 = 0, time.perf_counter()
    while time.perf_counter() - t1 < seconds:
        next(it)
        n += 1
    elapsed = time.perf_counter() - t1
    del it  # shuts the DataLoader workers down, so their CPU time is counted
    gc.collect()
    cpu = _cpu_seconds() - cpu0
    return {"startup_s": startup, "batches": n, "tokens": n * tokens_per_batch, "seconds": elapsed,
            "tokens_per_s": n * tokens_per_batch / elapsed,
            "cpu_s_per_mtok": cpu / ((n + warm + 1) * tokens_per_batch) * 1e6}


def interleaved(runs: list[tuple[str, int, Callable[[], Iterator]]], rounds: int, seconds: float,
                tokens: int, warmup: float) -> list[tuple[str, int, list[dict]]]:
    """Measure every run once per round, in a rotated order, ``rounds`` times; all rounds kept."""
    per_run: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    for i in range(rounds):
        for name, _, make in runs[i % len(runs):] + runs[:i % len(runs)]:
            per_run[name].append(measure(make, seconds, tokens, warmup))
    return [(name, procs, per_run[name]) for name, procs, _ in runs]


BASE, PIPE, CORPUS = "baseline (1 doc/call, list concat)", "pipeline {} workers", "corpus in-process"


def paired(results: dict[str, list[dict]], top: str, bottom: str) -> list[float]:
    """tokens/s of ``top`` over ``bottom``, per round (both measured in the same round)."""
    return [t["tokens_per_s"] / b["tokens_per_s"] for t, b in zip(results[top], results[bottom])]


def summarize(results: list[tuple[str, int, list[dict]]], pipe: str) -> dict:
    """Per run: median and best tokens/s, median CPU s/Mtok, median start-up; the ratios corpus / today's pipeline
    and pipeline / baseline, each the median over rounds of the ratio within a round (a slow or fast spell of the
    shared machine affects both sides of it)."""
    med = statistics.median
    rows = {name: {"procs": procs,
                   "tokens_per_s": med([r["tokens_per_s"] for r in rs]),
                   "best_tokens_per_s": max(r["tokens_per_s"] for r in rs),
                   "cpu_s_per_mtok": med([r["cpu_s_per_mtok"] for r in rs]),
                   "startup_s": med([r["startup_s"] for r in rs])}
            for name, procs, rs in results}
    by_name = {name: rs for name, _, rs in results}
    corpus, text = paired(by_name, CORPUS, pipe), paired(by_name, pipe, BASE)
    return {"rows": rows, "corpus_ratio_rounds": corpus, "corpus_ratio": med(corpus),
            "ratio_rounds": text, "ratio": med(text),
            "ratio_best": rows[pipe]["best_tokens_per_s"] / rows[BASE]["best_tokens_per_s"]}


def report(results: list[tuple[str, int, list[dict]]], args: argparse.Namespace, corpus: Path,
           load_before: float, same: bool, built: dict, memory: dict) -> None:
    """The table, then one JSON line."""
    pipe_name = PIPE.format(args.num_workers)
    s = summarize(results, pipe_name)
    rows, base, pipe = s["rows"], s["rows"][BASE], s["rows"][pipe_name]
    print(f"data pipeline, T={args.seq_len} B={args.batch_size}, {os.cpu_count()} CPUs, load avg "
          f"{load_before:.1f} before / {os.getloadavg()[0]:.1f} after, {args.rounds} rounds of "
          f"{args.seconds:g} s after {args.warmup:g} s warm-up (medians), corpus {corpus}")
    print(f"{'source':40s} {'procs':>5s} {'tokens/s':>12s} {'best':>12s} {'tok/s/proc':>11s} "
          f"{'vs base':>8s} {'CPU s/Mtok':>10s} {'startup':>8s}")
    for name, procs, _ in results:
        r = rows[name]
        print(f"{name:40s} {procs:5d} {r['tokens_per_s']:12,.0f} {r['best_tokens_per_s']:12,.0f} "
              f"{r['tokens_per_s'] / procs:11,.0f} {r['tokens_per_s'] / base['tokens_per_s']:7.2f}x "
              f"{r['cpu_s_per_mtok']:10.3f} {r['startup_s']:7.2f}s")
    print(f"corpus in-process / {pipe_name}, per round: {' '.join(f'{x:.1f}' for x in s['corpus_ratio_rounds'])}; "
          f"median {s['corpus_ratio']:.1f}x (target >= 10x)")
    print(f"pipeline / baseline, per round: {' '.join(f'{x:.2f}' for x in s['ratio_rounds'])}; "
          f"median {s['ratio']:.2f}x, best rounds {s['ratio_best']:.2f}x (target >= 3x); "
          f"same token stream on both sides: {same}")
    if built["cached"]:
        print(f"tokenized once: {built['tokens']:,} tokens, by an earlier run into --work_dir (reused)")
    else:
        print(f"tokenized once: {built['tokens']:,} tokens in {built['seconds']:.1f} s "
              f"({built['tokens'] / max(built['seconds'], 1e-9):,.0f} tokens/s, one process)")
    for size, m in memory.items():
        print(f"corpus reader, {size} ({m['tokens']:,} tokens, {m['shards']} shards): resident memory after opening "
              f"+{m['anon_open_mib']:.1f} MiB anonymous, +{m['file_open_mib']:.1f} MiB mapped file; after "
              f"{m['batches']} batches +{m['anon_read_mib']:.1f} MiB anonymous, +{m['file_read_mib']:.1f} MiB mapped")
    print(json.dumps({
        "bench": "data", "seq_len": args.seq_len, "batch_size": args.batch_size,
        "num_workers": args.num_workers, "cpus": os.cpu_count(), "rounds": args.rounds, "same_tokens": same,
        "warmup": args.warmup,
        "seconds": args.seconds, "load_avg_1min_before": round(load_before, 2),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "baseline_tokens_per_s": round(base["tokens_per_s"]),
        "pipeline_tokens_per_s": round(pipe["tokens_per_s"]),
        "corpus_tokens_per_s": round(rows[CORPUS]["tokens_per_s"]),
        "tokens_per_s_per_worker": round(pipe["tokens_per_s"] / max(1, args.num_workers)),
        "corpus_ratio": round(s["corpus_ratio"], 1), "corpus_ratio_rounds": [round(x, 1) for x in
                                                                              s["corpus_ratio_rounds"]],
        "ratio": round(s["ratio"], 2), "ratio_best": round(s["ratio_best"], 2),
        "ratio_rounds": [round(x, 2) for x in s["ratio_rounds"]],
        "tokens_per_s": {name: round(r["tokens_per_s"]) for name, r in rows.items()},
        "best_tokens_per_s": {name: round(r["best_tokens_per_s"]) for name, r in rows.items()},
        "cpu_s_per_mtok": {name: round(r["cpu_s_per_mtok"], 3) for name, r in rows.items()},
        "cpu_efficiency_ratio": round(base["cpu_s_per_mtok"] / pipe["cpu_s_per_mtok"], 2),
        "tokenize": built, "memory": memory}))


# ------------------------------------------------------------------------------------ the tokenized corpus
def tokenize_once(demo, out: Path) -> dict:
    """``llama_fp8 tokenize`` of the demo text into ``out`` (kept: a later run reuses it), timed."""
    cached = (out / mf.MANIFEST).is_file()
    t0 = time.perf_counter()
    if not cached:
        assert tokenize_cmd.main(["--dataset", str(demo.dataset_dir), "--tokenizer", str(demo.tokenizer_dir),
                                  "--out", str(out)]) == 0
    seconds = time.perf_counter() - t0
    tokens = open_corpus(str(out)).splits["train"].n_tokens
    return {"tokens": tokens, "seconds": round(seconds, 2), "cached": cached}


def grown(corpus: Path, out: Path, tokens: int, shards: int) -> Path:
    """A Megatron-format corpus of ``shards`` shards, each the corpus's train tokens repeated to ``tokens / shards``
    (its documents repeated with them): the same text at another size."""
    if (out / "done").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    split = open_corpus(str(corpus)).splits["train"]
    stream = np.empty(split.n_tokens, np.int64)
    split.read(0, stream)
    starts = split.doc_starts(0, split.n_tokens)
    lengths = np.diff(np.r_[starts, split.n_tokens])
    reps = max(1, -(-tokens // (shards * split.n_tokens)))
    for k in range(shards):
        writer = IndexedWriter(out / f"part-{k:03d}", np.dtype(np.uint16))
        for _ in range(reps):
            writer.add(stream, lengths)
        writer.finish()
    (out / "done").write_text("")
    return out


def memory_child(path: str, batches: int, seq_len: int, batch_size: int) -> None:
    """In a fresh process: resident memory above the start, after opening the corpus and after reading: anonymous
    (the process's own allocations) and file-backed (pages of the memory-mapped shards it touched: page cache, shared
    and reclaimable, bounded by what was read, not by the corpus's size)."""
    def rss_mib() -> dict[str, float]:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon:", "RssFile:")))
        return {k: int(v.split()[0]) / 1024 for k, v in fields.items()}

    cfg = Cfg(path, None, seq_len, batch_size, 0, doc_masking=True)
    before = rss_mib()
    loader = data.build_train_loader(cfg, 0, 1)
    opened = rss_mib()
    it = iter(loader)
    for _ in range(batches):
        next(it)
    after = rss_mib()
    print(json.dumps({"anon_open_mib": opened["RssAnon"] - before["RssAnon"],
                      "file_open_mib": opened["RssFile"] - before["RssFile"],
                      "anon_read_mib": after["RssAnon"] - before["RssAnon"],
                      "file_read_mib": after["RssFile"] - before["RssFile"]}))


def measure_memory(corpus: Path, work: Path, args: argparse.Namespace) -> dict:
    out = {}
    for size, factor, shards in (("1x", 1, 2), ("10x", 10, 20)):
        path = grown(corpus, work / f"grown_{args.memory_tokens}_{size}", args.memory_tokens * factor, shards)
        proc = subprocess.run([sys.executable, __file__, "--_memory_child", str(path), "--memory_batches",
                               str(args.memory_batches), "--seq_len", str(args.seq_len), "--batch_size",
                               str(args.batch_size)], capture_output=True, text=True, check=True)
        split = open_corpus(str(path)).splits["train"]
        out[size] = {"tokens": split.n_tokens, "shards": len(split.shards), "batches": args.memory_batches,
                     **{k: round(v, 1) for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}}
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print the table and the JSON line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work_dir", default=os.path.join(tempfile.gettempdir(), "llama_fp8_bench_data"))
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--num_workers", type=int, default=2)
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per run and round")
    p.add_argument("--warmup", type=float, default=1.0, help="untimed seconds after the first batch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--memory_tokens", type=int, default=20_000_000, help="tokens of the smaller corpus of the "
                   "memory measurement (the larger one has 10x)")
    p.add_argument("--memory_batches", type=int, default=500, help="batches each memory measurement reads")
    p.add_argument("--_memory_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._memory_child:
        memory_child(args._memory_child, args.memory_batches, args.seq_len, args.batch_size)
        return 0
    # One tokenizer thread everywhere, as in the DataLoader workers: otherwise the in-process row
    # would use every core until the first worker run sets this (build_train_loader does).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    demo = demo_data.prepare_demo_data(args.work_dir)
    built = tokenize_once(demo, Path(args.work_dir) / "tokenized")
    cfg = Cfg(str(demo.dataset_dir), str(demo.tokenizer_dir), args.seq_len, args.batch_size, args.num_workers)
    data.validate_data_config(cfg)  # opens (and caches) the arrow files outside the timings
    same = same_tokens(cfg)

    def pipeline(workers: int, dataset: str = cfg.dataset, tok: str | None = cfg.tokenizer) -> Callable[[], Iterator]:
        c = Cfg(**{**cfg.__dict__, "num_workers": workers, "dataset": dataset, "tokenizer": tok})
        return lambda: iter(data.build_train_loader(c, 0, 1))

    corpus = str(Path(args.work_dir) / "tokenized")
    runs = [(BASE, 1, lambda: baseline_batches(cfg)),
            ("pipeline in-process (--num_workers=0)", 1, pipeline(0)),
            ("pipeline 1 worker", 1, pipeline(1)),
            (PIPE.format(args.num_workers), max(1, args.num_workers), pipeline(args.num_workers)),
            (CORPUS, 1, pipeline(0, corpus, None)),
            (f"corpus {args.num_workers} threads ahead", 1, pipeline(args.num_workers, corpus, None))]
    load_before = os.getloadavg()[0]
    results = interleaved(runs, args.rounds, args.seconds, args.batch_size * args.seq_len, args.warmup)
    memory = measure_memory(Path(corpus), Path(args.work_dir), args)
    report(results, args, demo.dataset_dir, load_before, same, built, memory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
