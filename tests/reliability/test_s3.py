"""Checkpoints on S3 against a real S3-compatible server (SeaweedFS on 127.0.0.1, tests/s3kit.py), through the
Amazon S3 Connector for PyTorch: the same guarantees as on disk, every fault row of the matrix's S3 section, the two
tiers. Each run is the matrix's (faultkit.RUN: 6 steps, a checkpoint every 2) and is compared with the
uninterrupted run on disk (ref1, ref2): the losses after the resume and the final shards, bitwise."""

from __future__ import annotations

import shutil
import zlib

import faultkit as F
import pytest
import s3kit

from helpers import read_metrics
from llama_fp8 import errors
from llama_fp8.checkpoint.s3 import S3Location

pytestmark = pytest.mark.slow
SHORT = [a if a != str(F.STEPS) else "4" for a in F.RUN]  # the same run, stopped after step 4


def s3_shard_sums(endpoint: str, ckpt: str) -> dict[str, str]:
    """CRC32 of the shards of an S3 checkpoint (read here, not from its manifest): the same as faultkit.shard_sums."""
    st, where = s3kit.store(endpoint), S3Location.parse(ckpt)
    return {k.rsplit("/", 1)[-1]: f"{zlib.crc32(st.read(where / k, 1 << 40)):08x}"
            for k in sorted(st.list(where)) if k.endswith(".distcp")}


def steps_on(endpoint: str, prefix: str) -> dict[int, set[str]]:
    """step -> the object names under s3://BUCKET/prefix/step_N/."""
    out: dict[int, set[str]] = {}
    for key in s3kit.store(endpoint).list(S3Location(s3kit.BUCKET, prefix)):
        head, _, rest = key.partition("/")
        if head.startswith("step_") and head[5:].isdigit():
            out.setdefault(int(head[5:]), set()).add(rest)
    return out


def resumed_from(run_dir) -> list[int]:
    return [r["start_step"] for r in read_metrics(run_dir) if r["type"] == "meta"]


def test_s3_save_and_exact_resume_one_rank(tmp_path, s3_server, ref1):
    flags = s3kit.s3_flags(s3_server, "one")
    run = tmp_path / "run"
    assert F.run1(run, [*SHORT, *flags]) == 0
    on = steps_on(s3_server.endpoint, "one")
    assert sorted(on) == [2, 4] and all("COMPLETE" in names for names in on.values()), on
    assert F.run1(run, [*F.RUN, *flags]) == 0
    assert resumed_from(run) == [0, 4]
    got = F.losses(run)
    assert [got[s] for s in (5, 6)] == [ref1.losses[s] for s in (5, 6)]
    assert s3_shard_sums(s3_server.endpoint, f"s3://{s3kit.BUCKET}/one/step_6") == ref1.final
    assert sorted(steps_on(s3_server.endpoint, "one")) == [4, 6]  # --keep_last_k 2 on S3
    assert errors.EXIT_TRANSIENT == 75
    shutil.rmtree(run, ignore_errors=True)
