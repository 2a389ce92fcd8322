"""The checkpoint file system misbehaving under real 2-rank runs: it fills up during a save, or it is
read-only from the start. A size-limited tmpfs is mounted where the test may mount (root); elsewhere
a file-size limit (RLIMIT_FSIZE) or a path that cannot be a folder stands in for it."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import time

import pytest
from faultkit import (
    RUN,
    SMALL,
    assert_matches_reference,
    complete,
    exit_text,
    finish,
    last_step,
    launch,
    leftovers,
    run2,
    starts,
)

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def tmpfs(path, size_mib: int, read_only: bool = False):
    """A tmpfs of ``size_mib`` at ``path``; yields False (nothing mounted) where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size_mib}m" + (",ro" if read_only else "")
    ok = not os.environ.get("LLAMA_FP8_TEST_NO_MOUNT") and subprocess.run(  # the variable tests the fallbacks
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True).returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], check=False)


def grow(path, size_mib: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_mib}m", str(path)], check=True)


def test_disk_full_during_save(tmp_path, ref2, row):
    """Checkpoints are ~17 MB here: a 26 MiB file system takes step_2, and fills up during step_4."""
    b, ck = tmp_path / "b", tmp_path / "ckfs"
    args = [*RUN, "--checkpoint_dir", str(ck)]
    with tmpfs(ck, 26) as mounted:
        if mounted:
            first = run2(b, args)
            how = "26 MiB tmpfs"
        else:  # no mount allowed: step_2 normally, then a run whose shards exceed a 4 MiB file-size limit
            assert run2(b, [*SMALL, "--max_steps", "2", "--checkpoint_freq", "2", "--checkpoint_dir", str(ck)]).rc == 0
            t0 = time.monotonic()
            limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))  # noqa: E731
            p = launch(b, args, preexec_fn=limit)
            first = finish(p, t0)
            how = "RLIMIT_FSIZE 4 MiB"
        assert first.rc == 2, (first.rc, first.err[-3000:])
        err = first.err
        assert err.count("checkpoint step_4 was not saved") == 1, err[-3000:]  # once: rank 0 reports for all
        if mounted:  # the message says the file system is full (ENOSPC may reach us as a short-write error)
            assert f"the file system of {ck} is FULL" in err, err[-3000:]
        else:  # a file-size limit: the file system itself has room, the write error is what names it
            assert f"checkpoint step_4 was not saved to {ck}" in err, err[-3000:]
        assert "the latest complete checkpoint (step_2) is intact" in err
        done = [int(p.name.split("_")[1]) for p in ck.iterdir() if p.name.startswith("step_")]
        assert done == [2] and (ck / "step_2" / "COMPLETE").is_file(), sorted(os.listdir(ck))
        before = last_step(b)
        if mounted:
            grow(ck, 96)  # space freed (without the limit, the RLIMIT variant has all it needs)
        second = run2(b, args)
        assert second.rc == 0, second.err[-3000:]
        resumed = starts(b)[-1]
        assert resumed == 2
        same = assert_matches_reference_dir(b, ck, ref2, resumed)
    line = [ln for ln in err.splitlines() if "was not saved" in ln][0]
    errors = rank_errors(line, ck)
    space = next((p for p in line.split("; ") if p.startswith("the file system of")), "")
    row(f"{how}: {exit_text(first.rc)}, one message: \"checkpoint step_4 was not saved to ckfs: {shorten(errors[0])}; "
        f"{space}; ... the latest complete checkpoint (step_2) is intact\"; only step_2 on disk; {same}",
        before - resumed)


def assert_matches_reference_dir(b, ck, ref, resumed):
    """assert_matches_reference for a run whose checkpoints are in ``ck``."""
    link = b / "checkpoints"
    if not link.exists():
        link.symlink_to(ck)
    return assert_matches_reference(b, ref, resumed)


def rank_errors(line: str, folder) -> list[str]:
    """The "rank N: ..." parts of a "checkpoint step_N was not saved to FOLDER: rank 0: ...; rank 1: ...; the file
    system ..." line."""
    return [p for p in line.split(f"was not saved to {folder}: ", 1)[-1].split("; ") if p.startswith("rank ")]


def test_rank_errors_are_read_from_a_message_that_names_one_rank_or_two():
    """The row above once read only the ranks after the first, and failed (IndexError) on a CI run whose message
    named one rank."""
    head = "llama-fp8 train: error: checkpoint step_4 was not saved to /x/ckfs: "
    tail = "; the file system of /x/ckfs is FULL: 0.1 MiB free of 26.0 MiB; the latest complete checkpoint (step_2) is intact"
    one = "rank 0: OSError: [Errno 28] No space left on device (/x/ckfs/step_4.tmp/__0_0.distcp)"
    two = "rank 1: RuntimeError: unexpected pos 4096 vs 2048"
    assert rank_errors(head + one + tail, "/x/ckfs") == [one]
    assert rank_errors(head + one + "; " + two + tail, "/x/ckfs") == [one, two]


def shorten(line: str, n: int = 260) -> str:
    text = line.split("error: ", 1)[-1]
    return text if len(text) < n else text[:n - 3] + "..."


def test_checkpoint_dir_not_writable(tmp_path, row):
    b, ck = tmp_path / "b", tmp_path / "ro"
    with tmpfs(ck, 4, read_only=True) as mounted:
        if mounted:
            how, target = "read-only tmpfs", ck
        elif os.geteuid() != 0:
            ck.mkdir()
            ck.chmod(0o555)
            how, target = "chmod 555", ck
        else:  # root ignores permission bits: a checkpoint dir below a regular file cannot be created
            (tmp_path / "file").write_text("")
            how, target = "a path below a regular file", tmp_path / "file" / "ckpt"
        r = run2(b, [*RUN, "--checkpoint_dir", str(target)], timeout=120)
    assert r.rc == 2, (r.rc, r.err[-3000:])
    assert r.err.count(f"--checkpoint_dir {target} is not writable") == 1, r.err[-3000:]
    assert "M parameters" not in r.err and not (b / "metrics.jsonl").exists()  # stopped before the model was built
    assert complete(b) == [] and leftovers(b) == []
    row(f"{how}: exit 2 after {r.seconds:.0f} s, before the model was built: "
        f"\"{shorten([ln for ln in r.err.splitlines() if 'not writable' in ln][0])}\"", None)
