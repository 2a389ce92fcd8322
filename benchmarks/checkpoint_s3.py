"""The S3 rounds of bench_checkpoint.py (``--s3``): our save and load through the Amazon S3 Connector for PyTorch
against a plain multipart upload and download of the same bytes to the same server, at several thread counts; and
the two tiers' stall: training steps while a checkpoint is copied to S3 in the background against steps without.

- plain upload: each rank splits its shards (parameters, then optimizer states) into T objects and uploads them
  from T threads, each one object streamed through the connector's client (the AWS CRT client sends it as a
  multipart upload of 8 MiB parts): the bytes a checkpoint must hold, nothing else;
- ours save: ``Checkpointer.save`` to ``s3://`` with ``--s3_threads T``: WRITER, the per-rank state, DCP's shards
  through the connector's ``S3StorageWriter`` (hashed on their way up), list-and-verify, the manifest;
- plain download: T threads each read one of those objects whole (one ranged GET) into memory allocated before;
- ours load: ``Checkpointer.load``: the manifest, train_state.json, .metadata through the allow-list unpickler,
  every shard read forward in 64 MiB ranged GETs and verified block by block, resharded by DCP;
- tiers: ``Checkpointer.save`` to a folder alone, and with a copy to S3 configured (the time ``save`` blocks
  training either way), then training steps while that copy runs against the same number of steps without one.
"""

from __future__ import annotations

import statistics
import threading
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _groups(tensors: list[torch.Tensor], n: int) -> list[list[torch.Tensor]]:
    """``tensors`` split into ``n`` groups of about equal bytes (in order)."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    out, acc = [[] for _ in range(n)], 0
    for t in tensors:
        out[min(n - 1, acc * n // max(total, 1))].append(t)
        acc += t.numel() * t.element_size()
    return [g for g in out if g]


def _plain_upload(client, bucket: str, key: str, groups: list[list[torch.Tensor]]) -> None:
    def one(i: int, group: list[torch.Tensor]) -> None:
        with client.put_object(bucket, f"{key}/{i}") as w:
            for t in group:
                w.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))

    _threads([lambda i=i, g=g: one(i, g) for i, g in enumerate(groups)])


def _plain_download(client, bucket: str, key: str, buffers: list[torch.Tensor]) -> None:
    from s3torchconnector import S3ReaderConstructor

    def one(i: int, buf: torch.Tensor) -> None:
        reader = client.get_object(bucket, f"{key}/{i}", reader_constructor=S3ReaderConstructor.range_based(0))
        view, got = memoryview(buf.numpy()), 0
        while got < len(view) and (n := reader.readinto(view[got:])):
            got += n
        assert got == len(view), (got, len(view))

    _threads([lambda i=i, b=b: one(i, b) for i, b in enumerate(buffers)])


def _threads(jobs) -> None:
    errors: list[BaseException] = []

    def run(job) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def s3_rounds(s, cfg, env, args, tensors: list[torch.Tensor]) -> dict[str, list[float]]:
    """Seconds of every S3 variant, ``args.rounds`` times per thread count (plain and ours alternating)."""
    from llama_fp8 import checkpoint
    from llama_fp8.checkpoint.s3 import S3Location, S3Options
    from llama_fp8.checkpoint.s3.target import S3Target

    times: dict[str, list[float]] = {}
    for threads in args.s3_threads:
        options = S3Options(region=args.s3_region, endpoint=args.s3_endpoint, threads=threads)
        root = S3Location(args.s3_bucket, f"{args.s3_prefix}/ours_t{threads}")
        ours = checkpoint.Checkpointer(root, 1, False, env.rank, env.world_size, s3=S3Target(root, options))
        _thread_count(s, cfg, env, args, tensors, threads, options.client(), ours, root, times)
    return times


def _thread_count(s, cfg, env, args, tensors, threads: int, client, ours, root, times) -> None:
    groups = _groups(tensors, threads)
    key = f"{args.s3_prefix}/plain_t{threads}/rank{env.rank}"

    def save_ours(step: int) -> None:
        ours.save(step, s.model, s.optimizer, s.scheduler, s.train_loader, cfg, s.plan)

    step = 100
    for r in range(args.rounds):
        step += 1
        for variant in (("plain", "ours") if r % 2 == 0 else ("ours", "plain")):
            if variant == "plain":
                times.setdefault(f"plain upload t{threads}", []).append(
                    _timed(partial(_plain_upload, client, args.s3_bucket, key, groups)))
            else:
                times.setdefault(f"ours save t{threads}", []).append(_timed(partial(save_ours, step)))
    buffers = [torch.empty(sum(t.numel() * t.element_size() for t in g), dtype=torch.uint8) for g in groups]
    last = root / f"step_{step}"
    for r in range(args.rounds):
        for variant in (("plain", "ours") if r % 2 == 0 else ("ours", "plain")):
            if variant == "plain":
                times.setdefault(f"plain download t{threads}", []).append(
                    _timed(partial(_plain_download, client, args.s3_bucket, key, buffers)))
            else:
                times.setdefault(f"ours load t{threads}", []).append(
                    _timed(partial(ours.load, last, s.model, s.optimizer, s.scheduler, s.train_loader)))


def tier_rounds(s, cfg, env, args, folder: Path) -> dict[str, list[float]]:
    """The tiers: how long a save to the file system blocks training with and without a copy to S3 configured,
    and training step times while that copy runs against steps without a copy."""
    from llama_fp8 import checkpoint
    from llama_fp8.checkpoint.s3 import S3Location, S3Options
    from llama_fp8.checkpoint.s3.copy import Copier
    from llama_fp8.checkpoint.s3.target import S3Target
    from llama_fp8.train import loop

    options = S3Options(region=args.s3_region, endpoint=args.s3_endpoint, threads=max(args.s3_threads))
    root = S3Location(args.s3_bucket, f"{args.s3_prefix}/tier")
    copier = Copier(S3Target(root, options), 1, 1) if env.rank == 0 else None
    plain = checkpoint.Checkpointer(folder / "plain", 1, False, env.rank, env.world_size)
    tiered = checkpoint.Checkpointer(folder / "tiered", 1, False, env.rank, env.world_size, copy=copier)
    it = iter(s.train_loader)
    times: dict[str, list[float]] = {k: [] for k in ("fs save", "fs save + copy", "step", "step during copy")}

    def save(ckpt, step: int) -> None:
        ckpt.save(step, s.model, s.optimizer, s.scheduler, s.train_loader, cfg, s.plan)

    step = 200
    for _ in range(args.rounds):
        step += 1
        times["fs save"].append(_timed(partial(save, plain, step)))
        for _ in range(args.tier_steps):
            times["step"].append(_timed(partial(loop.train_step, s, it, step)))
        step += 1
        times["fs save + copy"].append(_timed(partial(save, tiered, step)))
        for _ in range(args.tier_steps):  # the copy runs on rank 0 meanwhile
            copying = torch.tensor([int(copier is not None and copier.busy() is not None)])
            dist.all_reduce(copying)
            dt = _timed(partial(loop.train_step, s, it, step))
            if int(copying.item()):
                times["step during copy"].append(dt)
        _timed(tiered.join_copy)
    if copier is not None:
        assert copier.failures == 0 and copier.copied, (copier.failures, copier.copied)
    return times


def report(args, nbytes: int, times: dict[str, list[float]], load: float) -> dict:
    """The S3 table (median MiB/s and the ratios ours/plain per thread count) and the tiers' stall."""
    mib = nbytes / 2**20
    med = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"S3 ({args.s3_endpoint}, bucket {args.s3_bucket}): {mib:.0f} MiB of weights + AdamW moments, "
          f"{args.rounds} rounds per variant, median MiB/s; load avg {load:.2f}")
    print(f"{'threads':>7s} {'plain up':>9s} {'ours save':>9s} {'ratio':>6s} {'plain down':>10s} {'ours load':>9s} "
          f"{'ratio':>6s}")
    rows = {}
    for t in args.s3_threads:
        up, save = mib / med[f"plain upload t{t}"], mib / med[f"ours save t{t}"]
        down, loadr = mib / med[f"plain download t{t}"], mib / med[f"ours load t{t}"]
        rows[t] = {"plain_upload_mibs": round(up, 1), "ours_save_mibs": round(save, 1), "save_ratio": round(save / up, 3),
                   "plain_download_mibs": round(down, 1), "ours_load_mibs": round(loadr, 1),
                   "load_ratio": round(loadr / down, 3)}
        print(f"{t:7d} {up:9.1f} {save:9.1f} {save / up:6.2f} {down:10.1f} {loadr:9.1f} {loadr / down:6.2f}")
    tier = {}
    if med.get("step during copy") and med.get("step"):
        tier = {"fs_save_s": round(med["fs save"], 4), "fs_save_with_copy_s": round(med["fs save + copy"], 4),
                "save_stall_s": round(med["fs save + copy"] - med["fs save"], 4), "step_s": round(med["step"], 4),
                "step_during_copy_s": round(med["step during copy"], 4),
                "step_slowdown": round(med["step during copy"] / med["step"], 3),
                "steps_during_copy": len(times["step during copy"])}
        print(f"tiers: a save to the file system blocks {tier['fs_save_s']:.3f} s alone, {tier['fs_save_with_copy_s']:.3f} s "
              f"with the copy to S3 configured (stall {tier['save_stall_s']:+.3f} s); a training step takes "
              f"{tier['step_s']:.3f} s, {tier['step_during_copy_s']:.3f} s while the copy runs "
              f"({tier['step_slowdown']:.2f}x, {tier['steps_during_copy']} steps measured during copies)")
    return {"s3_threads": rows, "tiers": tier}
