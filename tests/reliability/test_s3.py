"""Checkpoints on S3 against a real S3-compatible server (SeaweedFS on 127.0.0.1, tests/s3kit.py), through the
Amazon S3 Connector for PyTorch: the same guarantees as on disk, every fault row of the matrix's S3 section, the two
tiers. Each run is the matrix's (faultkit.RUN: 6 steps, a checkpoint every 2) and is compared with the
uninterrupted run on disk (ref1, ref2): the losses after the resume and the final shards, bitwise."""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
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


@pytest.fixture(scope="module")
def short_on_s3(s3_server, tmp_path_factory):
    """The matrix run stopped after step 4, its checkpoints on S3 (s3://BUCKET/base): the tests resume copies of it
    (one short run for all of them)."""
    run = tmp_path_factory.mktemp("short") / "run"
    assert F.run1(run, [*SHORT, *s3kit.s3_flags(s3_server, "base")]) == 0
    return run


def clone(endpoint: str, short_run, prefix: str, tmp_path):
    """s3://BUCKET/base copied (server-side) to s3://BUCKET/<prefix>, and the short run's folder beside it."""
    st, base, dst = s3kit.store(endpoint), S3Location(s3kit.BUCKET, "base"), S3Location(s3kit.BUCKET, prefix)
    for key in st.list(base):
        st.copy(base / key, dst / key)
    shutil.copytree(short_run, tmp_path / "run")
    return tmp_path / "run", s3kit.s3_flags(endpoint, prefix)


def test_s3_save_and_exact_resume_one_rank(tmp_path, s3_server, ref1, short_on_s3):
    on = steps_on(s3_server.endpoint, "base")
    assert sorted(on) == [2, 4] and all("COMPLETE" in names and "WRITER" in names for names in on.values()), on
    run, flags = clone(s3_server.endpoint, short_on_s3, "one", tmp_path)
    assert F.run1(run, [*F.RUN, *flags]) == 0
    assert resumed_from(run) == [0, 4]
    got = F.losses(run)
    assert [got[s] for s in (5, 6)] == [ref1.losses[s] for s in (5, 6)]
    assert s3_shard_sums(s3_server.endpoint, f"s3://{s3kit.BUCKET}/one/step_6") == ref1.final
    assert sorted(steps_on(s3_server.endpoint, "one")) == [4, 6]  # --keep_last_k 2 on S3
    # the HF export reads the S3 checkpoint (verified, safely) into the same weights as the one on disk
    from llama_fp8 import convert

    assert convert.main([f"s3://{s3kit.BUCKET}/one", str(tmp_path / "hf_s3"), "--s3_region", s3kit.REGION,
                         "--s3_endpoint", s3_server.endpoint, "--dtype", "fp32"]) == 0
    assert convert.main([str(ref1.run_dir / "checkpoints"), str(tmp_path / "hf_disk"), "--dtype", "fp32"]) == 0
    assert (tmp_path / "hf_s3" / "model.safetensors").read_bytes() == \
        (tmp_path / "hf_disk" / "model.safetensors").read_bytes()


def _short_then_full(run, flags, ref, damage=None) -> None:
    """The run to step 4, ``damage()`` to what it left, then the rerun to step 6."""
    assert F.run1(run, [*SHORT, *flags]) == 0
    if damage:
        damage()
    assert F.run1(run, [*F.RUN, *flags]) == 0


def _damaged_then_full(s3_server, short_run, prefix: str, tmp_path, damage):
    """A copy of the short run's checkpoints, ``damage(store, root)`` to it, then the rerun to step 6."""
    run, flags = clone(s3_server.endpoint, short_run, prefix, tmp_path)
    damage(s3kit.store(s3_server.endpoint), S3Location(s3kit.BUCKET, prefix))
    assert F.run1(run, [*F.RUN, *flags]) == 0
    return run


def test_s3_rank_killed_mid_upload_two_ranks(tmp_path, s3_server, ref2, row):
    run, flags = tmp_path / "run", s3kit.s3_flags(s3_server, "killed")
    r = F.run2(run, [*F.RUN, *flags], fault="kill@save.uploading:step=4:rank=1", timeout=600)
    assert r.rc != 0
    left = steps_on(s3_server.endpoint, "killed")
    assert "COMPLETE" in left[2] and "COMPLETE" not in left.get(4, set()) and "WRITER" in left[4], left
    half = sorted(left[4])
    r2 = F.run2(run, [*F.RUN, *flags], timeout=600)
    assert r2.rc == 0, r2.err[-3000:]
    assert resumed_from(run) == [0, 2]
    seen = F.assert_matches_reference_s3(run, ref2, 2, s3_shard_sums(s3_server.endpoint,
                                                                       f"s3://{s3kit.BUCKET}/killed/step_6"))
    assert sorted(steps_on(s3_server.endpoint, "killed")) == [4, 6]  # the half-written step_4 swept, saved again;
    # step_2 retired by --keep_last_k, its deletion waited for at the end of the run
    assert s3kit.SECRET_KEY not in r.err + r.out + r2.err + r2.out  # credentials are never logged
    row(f"{F.exit_text(r.rc)}; step_4 left half-written (WRITER, {len(half) - 1} other objects, no COMPLETE); the "
        f"rerun resumed from step_2 and swept it; {seen}", 2)


def test_s3_resume_at_another_world_size(tmp_path, s3_server, ref2):
    """A 2-rank S3 checkpoint resumed by 1 rank reshards exactly as the same checkpoint on disk does."""
    src = tmp_path / "ref_step_4"
    shutil.copytree(ref2.run_dir / "checkpoints" / "step_4", src / "step_4")
    two = tmp_path / "two"
    saved = F.run2(two, [*SHORT, *s3kit.s3_flags(s3_server, "world", threads=2), "--s3_prefix_strategy", "hex"],
                   timeout=600)
    assert saved.rc == 0, saved.err[-3000:]
    keys = s3kit.store(s3_server.endpoint).list(S3Location(s3kit.BUCKET, "world/step_4"))
    assert sum(k.endswith(".distcp") and "/" in k for k in keys) >= 3, keys  # 2 threads x 2 ranks, spread by hex
    via_s3, via_disk = tmp_path / "s3", tmp_path / "disk"
    assert F.run1(via_s3, [*F.RUN, *s3kit.s3_flags(s3_server, "world1"), "--resume_from_checkpoint",
                           f"s3://{s3kit.BUCKET}/world/step_4"]) == 0
    assert F.run1(via_disk, [*F.RUN, "--checkpoint_dir", str(tmp_path / "c"), "--resume_from_checkpoint",
                             str(src / "step_4")]) == 0
    assert resumed_from(via_s3) == resumed_from(via_disk) == [4]
    assert F.losses(via_s3) == F.losses(via_disk)


def test_s3_throttled_with_503_slow_down(tmp_path, s3_server, ref1, row):
    proxy = s3kit.Proxy503(s3_server.ports["s3"], every=4, limit=60)
    try:
        run = tmp_path / "run"
        _short_then_full(run, [*s3kit.s3_flags(proxy, "throttled"), "--async_checkpoint", "1"], ref1)
    finally:
        proxy.shutdown()
    assert proxy.injected >= 10, proxy.injected
    seen = F.assert_matches_reference_s3(run, ref1, 4, s3_shard_sums(s3_server.endpoint,
                                                                       f"s3://{s3kit.BUCKET}/throttled/step_6"))
    row(f"{proxy.injected} of {proxy.seen} requests answered 503 Slow Down; every save (async) and the load retried by "
        f"the client, no exit; {seen}", 0)


def test_s3_server_down_during_a_save_and_back_before_the_next(tmp_path, s3_server, ref1, row, monkeypatch):
    from llama_fp8 import faults
    from llama_fp8.checkpoint.s3 import store as store_mod

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")  # the client's own tries of a request that cannot succeed
    real_at = faults.at
    downed = []

    def at(point, step=None):
        if point == "save.files_written" and step == 4 and not downed:
            downed.append(step)
            s3_server.stop()  # the server goes away mid-save: the shards cannot be written
        return real_at(point, step)

    monkeypatch.setattr(faults, "at", at)
    monkeypatch.setattr(store_mod, "RETRY_PAUSES", (0.5,))
    run, flags = tmp_path / "run", s3kit.s3_flags(s3_server, "down")
    try:
        rc = F.run1(run, [*F.RUN, *flags])
    finally:
        s3_server.start()  # back before the next save
    try:  # start() returned: its S3 gateway answers (before, a restarted server's refused at first)
        urllib.request.urlopen(s3_server.endpoint, timeout=5).close()
    except urllib.error.HTTPError:
        pass  # 403 without a signature: it answered
    monkeypatch.setattr(faults, "at", real_at)
    assert downed == [4] and rc == errors.EXIT_TRANSIENT, rc
    assert sorted(s for s, names in steps_on(s3_server.endpoint, "down").items() if "COMPLETE" in names) == [2]
    assert F.run1(run, [*F.RUN, *flags]) == 0
    assert resumed_from(run) == [0, 2]
    seen = F.assert_matches_reference_s3(run, ref1, 2, s3_shard_sums(s3_server.endpoint,
                                                                       f"s3://{s3kit.BUCKET}/down/step_6"))
    row(f"exit {rc} (transient: the launcher restarts) after the client's retries; step_2 intact; with the server back "
        f"the rerun resumed from step_2; {seen}", 2)


def test_s3_half_written_prefix_is_never_loaded(tmp_path, s3_server, ref1, short_on_s3, row):
    run = _damaged_then_full(s3_server, short_on_s3, "half", tmp_path,
                             lambda st, root: st.delete(root / "step_4" / "COMPLETE"))
    assert resumed_from(run) == [0, 2]
    seen = F.assert_matches_reference_s3(run, ref1, 2, s3_shard_sums(s3_server.endpoint,
                                                                       f"s3://{s3kit.BUCKET}/half/step_6"))
    row(f"step_4 without its manifest was not a candidate; resumed from step_2; the rerun's save of step_4 replaced "
        f"the half-written objects; {seen}", 2)


def test_s3_manifest_without_its_shards_falls_back(tmp_path, s3_server, ref1, short_on_s3, row):
    def drop_shards(st, root):
        for key in st.list(root / "step_4"):
            if key.endswith(".distcp"):
                st.delete(root / "step_4" / key)

    run = _damaged_then_full(s3_server, short_on_s3, "noshards", tmp_path, drop_shards)
    assert resumed_from(run) == [0, 2]
    aside = steps_on(s3_server.endpoint, "noshards")
    kept = s3kit.store(s3_server.endpoint).list(S3Location(s3kit.BUCKET, "noshards/step_4.broken"))
    assert "BROKEN" in kept and "train_state.json" in kept, kept
    seen = F.assert_matches_reference_s3(run, ref1, 2, s3_shard_sums(s3_server.endpoint,
                                                                       f"s3://{s3kit.BUCKET}/noshards/step_6"))
    row(f"list-and-verify named the missing shard; step_4 set aside (manifest -> BROKEN, moved to step_4.broken/ "
        f"when step 4 was saved again, {len(kept)} objects kept); resumed from step_2; {seen}", 2)
    assert 6 in aside


def test_s3_planted_objects_that_are_not_ours_are_kept(tmp_path, s3_server, ref1, short_on_s3, row):
    st, root = s3kit.store(s3_server.endpoint), S3Location(s3kit.BUCKET, "planted")
    planted = {root / "step_4" / "notes.txt": b"not ours", root / "step_6" / "x.bin": b"someone's data",
               root / "README": b"hello"}
    run = _damaged_then_full(s3_server, short_on_s3, "planted", tmp_path,
                             lambda st, _: [st.write(k, v) for k, v in planted.items()])
    assert resumed_from(run) == [0, 4]
    assert st.read(root / "step_4" / "notes.txt", 100) == b"not ours"
    assert st.read(root / "step_6.incomplete" / "x.bin", 100) == b"someone's data"
    assert st.read(root / "README", 100) == b"hello"
    seen = F.assert_matches_reference_s3(run, ref1, 4, s3_shard_sums(s3_server.endpoint,
                                                                       f"s3://{s3kit.BUCKET}/planted/step_6"))
    row(f"an object in step_4 (not in its manifest) ignored and kept; a step_6/ prefix without WRITER moved to "
        f"step_6.incomplete/ before step 6 was saved; the bucket's other object untouched; {seen}", 0)


def test_s3_tier_resumes_from_s3_when_the_file_system_tier_is_gone(tmp_path, s3_server, ref1, row, monkeypatch):
    """The copy of step_2 is held until step_4 is saved (a copy slower than the checkpoint interval, as on a busy
    link): step_4's copy is skipped then, and the end of the run copies it. Before, the run ended with step_4 on the
    file system only ("s3://ckpt/tier/step_4/COMPLETE: missing")."""
    import threading

    from llama_fp8.checkpoint.s3 import copy as s3copy

    asked = threading.Event()
    real_destination, real_copy = s3copy.Copier.destination, s3copy.Copier.copy

    def destination(self, step):
        out = real_destination(self, step)
        if step == 4:
            asked.set()
        return out

    def held(self, folder, step):
        if step == 2:
            asked.wait(120)
        return real_copy(self, folder, step)

    monkeypatch.setattr(s3copy.Copier, "destination", destination)
    monkeypatch.setattr(s3copy.Copier, "copy", held)
    run, fs = tmp_path / "run", tmp_path / "fsx"
    flags = ["--checkpoint_dir", str(fs), "--checkpoint_copy_dir", f"s3://{s3kit.BUCKET}/tier",
             "--checkpoint_copy_every", "1", "--s3_region", s3kit.REGION, "--s3_endpoint", s3_server.endpoint,
             "--s3_threads", "1"]
    assert F.run1(run, [*SHORT, *flags]) == 0
    from llama_fp8.checkpoint import manifest
    from llama_fp8.checkpoint.s3 import read as s3read

    local = manifest.read_manifest(fs / "step_4")
    remote = s3read.read_manifest(s3kit.store(s3_server.endpoint), S3Location(s3kit.BUCKET, "tier/step_4"))
    assert local["copies"] == remote["copies"] == [str(fs / "step_4"), f"s3://{s3kit.BUCKET}/tier/step_4"]
    assert remote["files"] == local["files"]
    shutil.rmtree(fs)  # the cluster (and its FSx volume) is gone
    monkeypatch.undo()
    assert F.run1(run, [*F.RUN, *flags]) == 0
    assert resumed_from(run) == [0, 4]
    got = F.losses(run)
    assert [got[s] for s in (5, 6)] == [ref1.losses[s] for s in (5, 6)]
    assert F.shard_sums(fs / "step_6") == ref1.final
    row("every checkpoint copied to S3 in the background, both manifests name both copies; the file-system tier "
        "deleted; the rerun resumed from the S3 copy of step_4; losses of steps 5-6 and final weights bitwise equal "
        "to the uninterrupted run", 0)


def test_preflight_checks_the_bucket_is_writable_from_this_node(s3_server, monkeypatch):
    from llama_fp8 import config
    from llama_fp8.cluster.nodes import node_checks

    def check(prefix: str):
        cfg = config.parse_args(s3kit.s3_flags(s3_server, prefix))
        return node_checks.check_writable(node_checks.Settings(cfg=cfg, checkpoint_dir=cfg.checkpoint_dir))

    ok = check("preflight")
    assert ok.status == node_checks.OK and "writable" in ok.message, ok
    assert s3kit.store(s3_server.endpoint).list(S3Location(s3kit.BUCKET, "preflight")) == {}  # the probe deleted
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    bad = check("preflight-bad")
    assert bad.status == node_checks.FAIL and "preflight-bad" in bad.message and "not-the-key" not in bad.message


def test_s3_hostile_objects_are_refused_by_the_safe_reader(tmp_path, s3_server, monkeypatch):
    """The safe reader on objects: keys confined to the checkpoint's prefix, sizes capped, no pickle executed."""
    import json
    import os
    import pickle

    from llama_fp8.checkpoint import manifest, safe_io
    from llama_fp8.checkpoint.s3 import commit

    st, root = s3kit.store(s3_server.endpoint), S3Location(s3kit.BUCKET, "hostile")
    marker = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    def plant(name: str, objects: dict[str, bytes], listed: dict[str, bytes] | None = None) -> list[str]:
        ckpt = root / name
        for key, data in objects.items():
            st.write(ckpt / key, data)
        files = {k: manifest.entry(*manifest.digest_bytes(v)) for k, v in (listed or objects).items()}
        st.write(ckpt / "COMPLETE", manifest.manifest_text(2, 1, files).encode())
        return commit.verify(st, ckpt)

    state = json.dumps({"step": 2, "world_size": 1, "scheduler": {}}).encode()
    outside = plant("step_1", {"train_state.json": state, ".metadata": b"x"},
                    {"train_state.json": state, ".metadata": b"x", "../../other/secret": b"s"})
    assert any("not a plain key" in p for p in outside), outside
    pickled = plant("step_2", {"train_state.json": state, ".metadata": pickle.dumps(Payload())})
    assert any(".metadata" in p and "refused" in p for p in pickled) and not marker.exists(), pickled
    forged = plant("step_3", {"train_state.json": json.dumps({"step": -1, "world_size": 1, "scheduler": {}}).encode(),
                              ".metadata": b"x"})
    assert any("'step'" in p and "out of range" in p for p in forged), forged
    monkeypatch.setattr(safe_io, "MAX_JSON", 100)
    big = plant("step_4", {"train_state.json": state + b" " * 200, ".metadata": b"x"})
    assert any("more than the 100" in p for p in big), big
    assert [s for s, _ in commit.complete(st, root)] == [1, 2, 3, 4]  # refused, never deleted


def test_s3_a_complete_step_saved_again_is_kept_until_the_new_one_is_complete(s3_server):
    """Resuming from an older checkpoint saves a later step again: the earlier attempt's complete one is moved aside
    (server-side), not deleted, before the new objects are written; a failed new save leaves it there."""
    from llama_fp8.checkpoint.s3 import commit

    st, root = s3kit.store(s3_server.endpoint), S3Location(s3kit.BUCKET, "again")
    old = {"WRITER": b"{}", "COMPLETE": b"{}", "__0_0.distcp": b"old shard"}
    for key, data in old.items():
        st.write(root / "step_7" / key, data)
    commit.begin(st, root, 7, sweep=True)
    assert st.list(root / "step_7.replaced") == {k: len(v) for k, v in old.items()}
    assert set(st.list(root / "step_7")) == {"WRITER"}  # this save's marker only: nothing of the old one lost
