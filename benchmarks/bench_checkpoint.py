"""Checkpoint I/O: our save (sync and async) and load against writing and reading the same bytes raw.

Two ranks (gloo, CPU) build the real training state through ``train.state.start`` - an FSDP-sharded Llama
with FP32 master weights and AdamW moments, ~1.3 GB in all by default - and train one step so that every
optimizer state exists. Then, in one folder on one file system (``--dir``), the save rounds and, after
them, the load rounds (raw first, then ours first, ... within each; not interleaved, so that what a load
leaves in memory cannot change a save's time):

- raw write: each rank writes its local shards (parameters, then optimizer states) into one file, fsync;
- raw read: each rank reads its file back into preallocated tensors;
- ours save (sync): ``Checkpointer.save`` - per-rank file, DCP shards (fsynced, hashed whole and per
  4 MiB block as they are written), the manifest, the atomic rename;
- ours save (async): the same with ``--async_checkpoint 1``: the time ``save`` blocks the training thread
  (staging into host memory), then the time until the background write is finished (``wait``);
- ours load: ``Checkpointer.load`` (DCP reads and reshards, per-rank state, scheduler) with its read-path
  verification on: every shard file is read once, block by block, each block hashed and compared with the
  manifest before any tensor is loaded from it;
- ours load (unverified): the same load, the same reads, with every hash skipped and taken as matching,
  so that the read-path verification's cost is their ratio;
- ours verify: the start-up check of the same checkpoint (every file's size and checksum, files split
  between the ranks), which runs once per resume before the load.

Where a sync save's time goes is measured in the save rounds (rank 0, by wrapping the functions the save
calls): the per-rank file (``write_rank_state``), DCP serialization (``dcp.save``), the checksum pass
(``manifest.sums``), each less the fsyncs made inside it, and every fsync of the save (``os.fsync``); the
rest (agreement, train_state.json, manifest, rename) is "other".

Before every read, the files just written are dropped from the page cache (``posix_fadvise DONTNEED``
on each file: ours and raw alike), so reads come from the device, not from memory. A phase's time is
the slowest rank's (barriers around each phase). GB/s = bytes of model + optimizer state of all ranks /
seconds. Ratios: ours save / raw write and ours load / raw read (goal >= 0.6 each, on the medians); async
blocked time / sync save time (goal <= 0.2). Every variant is reported as the median and the spread (min -
max) of its --rounds repeats. Prints a table, then one JSON line ``{"bench": "checkpoint", ...}``.

With ``--s3 local`` (a SeaweedFS server started on 127.0.0.1 from the dev extra's ``weed``) or ``--s3 URL`` (an
S3-compatible endpoint, or ``aws`` for AWS's endpoint of ``--s3_region``, with ``--s3_bucket``), the S3 rounds run
instead (benchmarks/checkpoint_s3.py): our save and load through the Amazon S3 Connector for PyTorch against a
plain multipart upload and download of the same bytes to the same server, at each of ``--s3_threads``, and the two
tiers' stall. Prints its table, then one JSON line ``{"bench": "checkpoint_s3", ...}``.

Run: ``python benchmarks/bench_checkpoint.py`` (relaunches itself under torch.distributed.run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
GOAL_RATIO, GOAL_BLOCKED = 0.6, 0.2
PARTS = ("per-rank file", "DCP serialization", "fsync", "checksum pass")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden_width", type=int, default=1024, help="model width (default 1024)")
    p.add_argument("--num_layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--vocab_size", type=int, default=32000, help="vocabulary (default 32000)")
    p.add_argument("--intermediate_size", type=int, default=2816, help="MLP width (default 2816)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of every variant (default 5)")
    p.add_argument("--dir", default=None, help="the file system to measure: a new folder is made in this one for "
                                               "each run and removed after it (default: runs/)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    p.add_argument("--s3", default=None, help="run the S3 rounds instead: local (start SeaweedFS here), aws, or the "
                                              "endpoint URL of an S3-compatible store")
    p.add_argument("--s3_bucket", default="bench", help="bucket of the S3 rounds (created by --s3 local)")
    p.add_argument("--s3_region", default=os.environ.get("AWS_REGION", "us-east-1"), help="its region")
    p.add_argument("--s3_prefix", default=None, help="key prefix of the S3 rounds (default: bench_checkpoint/<pid of "
                                                     "the launching process>, the same on every rank)")
    p.add_argument("--s3_threads", type=lambda v: [int(x) for x in v.split(",")], default=[1, 4, 8],
                   help="upload/download threads per rank to measure (default 1,4,8)")
    p.add_argument("--tier_steps", type=int, default=6, help="training steps measured per copy (default 6)")
    args = p.parse_args(argv)
    args.s3_endpoint = None if args.s3 in (None, "aws", "local") else args.s3
    if args.rounds < 1 or args.nproc < 1:
        p.error("--rounds and --nproc must be >= 1")
    return args


def relaunch(args: argparse.Namespace, argv: list[str]) -> int:
    parent = args.dir or (REPO / "runs" if (REPO / "runs").is_dir() else None)
    folder = Path(tempfile.mkdtemp(prefix="bench_checkpoint-", dir=parent))  # a run's training refuses a used one
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    server, extra = None, []
    if args.s3 == "local":  # the tests' SeaweedFS (tests/s3kit.py), with the tests' keys
        sys.path.insert(0, str(REPO / "tests"))
        import s3kit

        server = s3kit.S3Server(folder / "s3server")
        server.start()
        s3kit.create_bucket(server, args.s3_bucket)
        env.update(AWS_ACCESS_KEY_ID=s3kit.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=s3kit.SECRET_KEY)
        extra = ["--s3", server.endpoint]
    if args.s3 and args.s3_prefix is None:  # one prefix for every rank
        extra += ["--s3_prefix", f"bench_checkpoint/{os.getpid()}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.abspath(__file__), *argv, *extra, "--dir", str(folder)]
    try:
        return subprocess.run(cmd, env=env).returncode
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def train_flags(args: argparse.Namespace, folder: Path, async_save: bool) -> list[str]:
    return ["--model", "tiny", "--device", "cpu", "--model_impl", "hf", "--hidden_width", str(args.hidden_width),
            "--num_layers", str(args.num_layers), "--vocab_size", str(args.vocab_size), "--num_heads", "16",
            "--num_key_value_heads", "8", "--intermediate_size", str(args.intermediate_size),
            "--max_context_width", "32", "--train_batch_size", "1", "--max_steps", "1000", "--seed", "0",
            "--run_dir", str(folder / "run"), "--checkpoint_dir", str(folder / "ckpt"), "--keep_last_k", "1",
            "--async_checkpoint", str(int(async_save)), "--resume_from_checkpoint", "none"]


def local_tensors(model, optimizer) -> list[torch.Tensor]:
    """This rank's shards of the parameters and optimizer states: the bytes a checkpoint must hold."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    out = [local(p).detach() for p in model.parameters()]
    for st in optimizer.state.values():
        out += [local(v) for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def drop_cache(folder: Path) -> None:
    """Evict ``folder``'s files from the page cache (they are fsynced, so their pages are clean)."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn) -> float:
    """Seconds of ``fn`` on the slowest rank (a barrier before and after)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def raw_write(path: Path, tensors: list[torch.Tensor]) -> None:
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())


def raw_read(path: Path, into: list[torch.Tensor]) -> None:
    with open(path, "rb", buffering=0) as f:
        for t in into:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            got = f.readinto(view)
            assert got == len(view), (got, len(view))


def rank_main(args: argparse.Namespace) -> int:
    from llama_fp8 import checkpoint, config, parallel
    from llama_fp8.train import loop, state

    folder = Path(args.dir)
    cfg = config.parse_args(train_flags(args, folder, False))
    env = parallel.init_distributed(cfg)
    s = state.start(cfg, env)
    try:
        s.model.train()
        loop.train_step(s, iter(s.train_loader), 1)  # every AdamW state exists
        tensors = local_tensors(s.model, s.optimizer)
        mine = sum(t.numel() * t.element_size() for t in tensors)
        total = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(total)
        nbytes = int(total.item())
        dest = [torch.empty_like(t) for t in tensors]

        if args.s3:
            return s3_main(args, s, cfg, env, tensors, nbytes, folder)
        raw = folder / "raw"
        raw.mkdir(exist_ok=True)
        raw_file = raw / f"rank{env.rank}.bin"
        sync = s.checkpointer
        asyn = checkpoint.Checkpointer(Path(cfg.checkpoint_dir), 1, True, env.rank, env.world_size)
        times: dict[str, list[float]] = {k: [] for k in ("raw write", "raw read", "ours save (sync)", "ours load",
                                                         "ours load (unverified)", "ours verify", "async blocked",
                                                         "async total", *PARTS, "other")}
        # The save rounds, then the load rounds, raw and ours alternating within each: what a load leaves
        # in memory changed the next save's time on a VM (see ours_load_round), so they are not interleaved.
        for r in range(args.rounds):
            for variant in (("raw", "ours") if r % 2 == 0 else ("ours", "raw")):
                if variant == "raw":
                    times["raw write"].append(timed(lambda: raw_write(raw_file, tensors)))
                else:
                    for k, v in ours_save_round(s, cfg, sync, asyn, 2 * r + 1, r % 2 == 0).items():
                        times[k].append(v)
        sync.save(2 * args.rounds + 1, s.model, s.optimizer, s.scheduler, s.train_loader, cfg, s.plan)
        path = Path(cfg.checkpoint_dir) / f"step_{2 * args.rounds + 1}"
        for r in range(args.rounds):
            for variant in (("raw", "ours") if r % 2 == 0 else ("ours", "raw")):
                if variant == "raw":
                    drop_cache(raw)
                    times["raw read"].append(timed(lambda: raw_read(raw_file, dest)))
                else:
                    for k, v in ours_load_round(s, cfg, env, sync, path).items():
                        times[k].append(v)
        if env.is_main:
            report(args, env.world_size, nbytes, {k: statistics.median(v) for k, v in times.items()}, times)
    finally:
        s.close()
        parallel.destroy_distributed()
    return 0


def s3_main(args, s, cfg, env, tensors, nbytes: int, folder: Path) -> int:
    """The S3 rounds and the tiers' (benchmarks/checkpoint_s3.py) instead of the disk rounds."""
    sys.path.insert(0, str(Path(__file__).parent))
    import checkpoint_s3

    times = checkpoint_s3.s3_rounds(s, cfg, env, args, tensors)
    times.update(checkpoint_s3.tier_rounds(s, cfg, env, args, folder / "tiers"))
    if env.is_main:
        load = os.getloadavg()[0]
        out = checkpoint_s3.report(args, nbytes, times, load)
        print(json.dumps({"bench": "checkpoint_s3", "world_size": env.world_size, "state_bytes": nbytes,
                          "rounds": args.rounds, "cpus": os.cpu_count(), "load_avg_1min": round(load, 2),
                          "median_s": {k: round(statistics.median(v), 4) for k, v in times.items() if v}, **out,
                          "ratio": min(r["save_ratio"] for r in out["s3_threads"].values())}), flush=True)
    return 0


class _Parts:
    """Seconds spent in each part of a save on this rank, by wrapping what the save calls; the fsyncs made
    inside a part count as fsync, not as that part."""

    def __init__(self) -> None:
        self.t = dict.fromkeys(PARTS, 0.0)
        self.inner_fsync = 0.0

    def wrap(self, owner, name: str, part: str) -> None:
        real = getattr(owner, name)

        def timed_call(*a, **kw):
            t0, before = time.perf_counter(), self.inner_fsync
            try:
                return real(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                if part == "fsync":
                    self.inner_fsync += dt
                    self.t["fsync"] += dt
                else:
                    self.t[part] += dt - (self.inner_fsync - before)
        setattr(owner, name, timed_call)


def _instrument() -> _Parts:
    from llama_fp8.checkpoint import checkpointer, files, manifest

    parts = _Parts()
    parts.wrap(files, "write_rank_state", "per-rank file")
    parts.wrap(checkpointer.dcp, "save", "DCP serialization")
    parts.wrap(os, "fsync", "fsync")
    parts.wrap(manifest, "sums", "checksum pass")
    return parts


_PARTS: _Parts | None = None


class _Matches(str):
    def __ne__(self, other) -> bool:
        return False

    def __eq__(self, other) -> bool:
        return True

    __hash__ = str.__hash__


class _NoHash:
    """A hasher that hashes nothing and matches every digest: a load through it is the verified load less
    its hashing and comparing, so that their ratio is what the verification costs."""

    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return _Matches("")


def ours_save_round(s, cfg, sync, asyn, step: int, sync_first: bool) -> dict[str, float]:
    """Our sync save (and where its time goes) and an async save, in the order given (alternated between
    rounds, like raw and ours: each finds the memory the other left)."""
    global _PARTS
    _PARTS = _PARTS or _instrument()
    out: dict[str, float] = {}

    def sync_save() -> None:
        _PARTS.t = dict.fromkeys(PARTS, 0.0)
        out["ours save (sync)"] = timed(lambda: sync.save(step, s.model, s.optimizer, s.scheduler, s.train_loader,
                                                          cfg, s.plan))
        out.update(_PARTS.t)
        out["other"] = out["ours save (sync)"] - sum(_PARTS.t.values())  # per round: the medians need not add up

    def async_save() -> None:
        out["async blocked"] = timed(lambda: asyn.save(step + 1, s.model, s.optimizer, s.scheduler, s.train_loader,
                                                       cfg, s.plan))
        out["async total"] = out["async blocked"] + timed(asyn.wait)

    for save in ((sync_save, async_save) if sync_first else (async_save, sync_save)):
        save()
    return out


def ours_load_round(s, cfg, env, sync, path: Path) -> dict[str, float]:
    """The start-up check of checkpoint ``path`` and its load, with and without the read-path verification.
    (Run apart from the saves: on a VM whose free memory goes back to the host, an earlier version's load,
    which allocated and freed a buffer as large as the file, made the next save faster, and this one's,
    which does not, made it slower: the phases' order, not the save's code, moved the save ratio by 0.2.)"""
    from llama_fp8.checkpoint import manifest
    from llama_fp8.checkpoint import safe_io as S

    drop_cache(path)
    out = {"ours verify": timed(lambda: manifest.verify(path, env.rank, env.world_size))}
    drop_cache(path)
    out["ours load"] = timed(lambda: sync.load(path, s.model, s.optimizer, s.scheduler, s.train_loader,
                                               cfg.train_batch_size))
    drop_cache(path)
    real = S.HASHERS
    S.HASHERS = {k: _NoHash for k in real}  # the same reads and loads, every digest taken as matching
    try:
        out["ours load (unverified)"] = timed(lambda: sync.load(path, s.model, s.optimizer, s.scheduler,
                                                                s.train_loader, cfg.train_batch_size))
    finally:
        S.HASHERS = real
    return out


def report(args, world: int, nbytes: int, med: dict[str, float], times: dict[str, list[float]]) -> None:
    gb = nbytes / 1e9
    rate = {k: gb / v for k, v in med.items() if k not in (*PARTS, "other") and v > 0}
    save_ratio = med["raw write"] / med["ours save (sync)"]
    load_ratio = med["raw read"] / med["ours load"]
    blocked = med["async blocked"] / med["ours save (sync)"]
    verify_cost = med["ours load"] / med["ours load (unverified)"]
    verify_load = gb / (med["ours verify"] + med["ours load"])
    share = {k: med[k] / med["ours save (sync)"] for k in (*PARTS, "other")}
    load = os.getloadavg()[0]
    print(f"checkpoint I/O: hf Llama hidden {args.hidden_width} x {args.num_layers} layers, vocab {args.vocab_size}: "
          f"{nbytes / 2**30:.2f} GiB of FP32 weights + AdamW moments over {world} ranks (gloo, CPU), "
          f"{args.rounds} alternating rounds: median and spread (min - max); files in {args.dir}; "
          f"{os.cpu_count()} CPUs, load avg {load:.2f}{' (busy machine)' if load > (os.cpu_count() or 1) else ''}")
    print(f"{'variant':24s} {'median s':>9s} {'min - max s':>15s} {'GB/s':>7s}")
    for k in ("raw write", "ours save (sync)", "async blocked", "async total", "raw read", "ours load",
              "ours load (unverified)", "ours verify"):
        print(f"{k:24s} {med[k]:9.3f} {min(times[k]):7.3f} - {max(times[k]):5.3f} {rate[k]:7.3f}")
    print("sync save, where the time goes (rank 0, median seconds and share of the save): " + ", ".join(
        f"{k} {med[k]:.3f} s ({100 * share[k]:.0f} %)" for k in PARTS) +
        f", other (agreement, manifest, rename) {med['other']:.3f} s ({100 * med['other'] / med['ours save (sync)']:.0f} %)")
    print(f"save ratio ours/raw: {save_ratio:.3f} (goal >= {GOAL_RATIO}); load ratio ours/raw (read-path verification "
          f"on): {load_ratio:.3f} (goal >= {GOAL_RATIO}); read-path verification costs {verify_cost:.3f}x an "
          f"unverified load; async save blocks training {blocked:.3f}x a sync save (goal <= {GOAL_BLOCKED}); "
          f"start-up verify + load: {verify_load:.3f} GB/s")
    print(json.dumps({
        "bench": "checkpoint", "world_size": world, "state_bytes": nbytes, "rounds": args.rounds,
        "cpus": os.cpu_count(), "load_avg_1min": round(load, 2),
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "spread_s": {k: [round(min(v), 4), round(max(v), 4)] for k, v in times.items()},
        "gbps": {k: round(v, 4) for k, v in rate.items()}, "save_share": {k: round(v, 4) for k, v in share.items()},
        "save_ratio": round(save_ratio, 4), "load_ratio": round(load_ratio, 4),
        "verify_cost_ratio": round(verify_cost, 4), "async_blocked_ratio": round(blocked, 4),
        "verify_and_load_gbps": round(verify_load, 4), "ratio": round(min(save_ratio, load_ratio), 4),
        "goal_ratio": GOAL_RATIO, "goal_blocked": GOAL_BLOCKED}), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if "RANK" not in os.environ:
        return relaunch(args, argv)
    return rank_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
