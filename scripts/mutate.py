#!/usr/bin/env python3
"""Mutation check of the test suite: does each behaviour we claim to test still get caught?

    .venv/bin/python scripts/mutate.py                     # every mutation in tests/mutations.yaml
    .venv/bin/python scripts/mutate.py --only exit-requeue-85 --skip-clean  # one (or a comma list)
    .venv/bin/python scripts/mutate.py --out tests/mutations-result.json

Each mutation is one small edit of the code (a threshold, an exit code, a sign, a skipped check, a dropped flush)
and the tests that must catch it. The script copies the tree (the files git knows, plus untracked ones it does not
ignore) to a scratch folder, checks that the listed tests pass there unmutated, then for each mutation applies the
edit to the scratch copy only, runs only its tests, and reports caught (a test failed), missed (all passed) or
timeout (the run outlasted --timeout: not a catch, see ``verdict``), with the run's wall and CPU seconds (the CPU
seconds are what it costs on a host of its own). The tree itself is never edited. The tests run with this
interpreter and the scratch copy's src/ first on PYTHONPATH, so in-process imports and the subprocesses the tests
start both see the mutated code. With --lock FILE the runs that hold tests marked slurm or container take an
exclusive flock on FILE first (the local Slurm cluster's ports are fixed: one such run at a time on a host).

A mutation's `old` text must occur exactly once in its file (else the list is stale: an error, not a miss).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LIST = REPO / "tests" / "mutations.yaml"
FIELDS = {"id", "file", "old", "new", "tests", "why"}


def load(path: Path) -> list[dict]:
    """The mutation list, checked: known keys only, unique ids, tests given."""
    items = yaml.safe_load(path.read_text())
    if not isinstance(items, list):
        raise SystemExit(f"{path}: expected a list of mutations")
    seen: set[str] = set()
    for m in items:
        unknown, missing = set(m) - FIELDS, FIELDS - set(m)
        if unknown or missing:
            raise SystemExit(f"{path}: mutation {m.get('id')!r}: unknown keys {sorted(unknown)}, "
                             f"missing {sorted(missing)}")
        if m["id"] in seen:
            raise SystemExit(f"{path}: duplicate mutation id {m['id']!r}")
        seen.add(m["id"])
        if not m["tests"]:
            raise SystemExit(f"{path}: mutation {m['id']!r} names no test")
    return items


def tree_files(repo: Path) -> list[str]:
    """Files git tracks, and untracked files it does not ignore (a change not committed yet is tested too)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=True).stdout
    return sorted({f for f in out.decode().split("\0") if f and (repo / f).is_file()})


def copy_tree(repo: Path, into: Path) -> None:
    for rel in tree_files(repo):
        dest = into / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        src = repo / rel
        if src.is_symlink():
            os.symlink(os.readlink(src), dest)
        else:
            shutil.copy2(src, dest)


def forget_bytecode(path: Path) -> None:
    """Remove the cached bytecode of ``path``: Python trusts a .pyc whose recorded source size and mtime (whole
    seconds) match, so an edit of the same size within the second of the last compile (a sign flipped back by the
    restore after a test run that failed at once) would otherwise run the previous text."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)


def apply(scratch: Path, m: dict) -> bytes:
    """Apply mutation m in the scratch copy; return the file's original bytes (to restore it exactly)."""
    path = scratch / m["file"]
    data = path.read_bytes()
    text = data.decode()
    n = text.count(m["old"])
    if n != 1:
        raise LookupError(f"{m['file']}: the text to mutate occurs {n} times (expected once): {m['old']!r}")
    path.write_bytes(text.replace(m["old"], m["new"], 1).encode())
    forget_bytecode(path)
    return data


def restore(scratch: Path, m: dict, original: bytes) -> None:
    path = scratch / m["file"]
    path.write_bytes(original)
    forget_bytecode(path)


def marked(scratch: Path, tests: list[str]) -> set[str]:
    """The ids of ``tests`` that select a test marked slurm or container (one collection)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(scratch / "src"), *filter(None, [os.environ.get(
        "PYTHONPATH")])]))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                          "slurm or container", *tests], cwd=scratch, env=env, capture_output=True, text=True).stdout
    found = {ln.strip() for ln in out.splitlines() if "::" in ln}
    return {t for t in tests if any(f == t or f.startswith(t + "[") or f.startswith(t + "::") for f in found)}


@contextlib.contextmanager
def held(lock: Path | None):
    """An exclusive flock on ``lock`` (the one flock(1) takes) for the duration; nothing without one."""
    if lock is None:
        yield
        return
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_tests(scratch: Path, tests: list[str], timeout: float) -> tuple[int | None, float, float, str]:
    """(pytest's exit code, or None if it ran past ``timeout``; seconds; CPU seconds of pytest and every process it
    waited for, what the run costs on a host of its own; the end of its output)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(scratch / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=--strict-markers",
           *tests]
    t0, cpu0 = time.monotonic(), _children_cpu()
    # its own process group: on a timeout the whole tree goes (the runs and launchers a test started too), not
    # only pytest, whose children would otherwise train on, orphaned, through the next mutation's run
    proc = subprocess.Popen(cmd, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, time.monotonic() - t0, _children_cpu() - cpu0, out[-2000:] + f"\n(timed out after {timeout:.0f} s)"
    return proc.returncode, time.monotonic() - t0, _children_cpu() - cpu0, out[-2000:]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def verdict(rc: int | None, out: str = "") -> str:
    """pytest's exit codes: 0 all passed (missed), 1 a test failed (caught). A run past --timeout (None) is its own
    result, not a catch: on a busy host a slow test times out with or without the mutation (a mutation that makes a
    test hang shows as a timeout of its run where the clean run finished). A run that passed with a test skipped
    (its prerequisite missing here: the local Slurm cluster, a GPU) did not run what should catch the mutation:
    skipped, not missed. 2-5, or pytest killed by a signal (< 0), mean the run itself was broken: an error."""
    if rc == 0 and skipped(out):
        return "skipped"
    return {0: "missed", 1: "caught", None: "timeout"}.get(rc, "error")


def skipped(out: str) -> int:
    """How many tests pytest's closing line says it skipped."""
    last = next((ln for ln in reversed(out.splitlines()) if " in " in ln and ("passed" in ln or "skipped" in ln)), "")
    found = re.search(r"(\d+) skipped", last)
    return int(found.group(1)) if found else 0


def clean_check(scratch: Path, every: list[str], locked: set[str], lock: Path | None, timeout: float) -> None:
    """The listed tests pass on the unmutated copy (those marked slurm or container under the lock), else exit."""
    for part, held_lock in (([t for t in every if t not in locked], None), ([t for t in every if t in locked], lock)):
        if not part:
            continue
        with held(held_lock):
            rc, secs, cpu, out = run_tests(scratch, part, timeout)
        print(f"clean run of {len(part)} test ids: rc {rc} in {secs:.0f} s ({cpu:.0f} CPU s)"
              + (f"; {skipped(out)} skipped: they cannot catch anything here" if skipped(out) else ""), flush=True)
        if rc != 0:
            print(out, file=sys.stderr)
            raise SystemExit("the listed tests do not pass on the unmutated tree: fix that first")


def run_one(scratch: Path, m: dict, lock: Path | None, timeout: float) -> dict:
    """Mutation m applied, its tests run (under ``lock`` if given), the file restored: its result record."""
    try:
        original = apply(scratch, m)
    except LookupError as e:
        return dict(id=m["id"], result="error", seconds=0.0, cpu_seconds=0.0, detail=str(e))
    try:
        with held(lock):
            rc, secs, cpu, out = run_tests(scratch, m["tests"], timeout)
    finally:
        restore(scratch, m, original)
    res = verdict(rc, out)
    return dict(id=m["id"], result=res, seconds=round(secs, 1), cpu_seconds=round(cpu, 1),
                detail=without_hosts_paths(why_caught(out) if res == "caught" else out[-800:]))


ABSOLUTE = re.compile(r"(?<![\w.:/])/(?:[\w.%+-]+/)+([\w.%+-]*)")


def without_hosts_paths(text: str) -> str:
    """A test's output as the committed result keeps it: an absolute path of this host (the scratch copy, pytest's
    temporary folders, a venv) cut to its last part, "<path>/NAME": the result says what failed, not where it ran."""
    return ABSOLUTE.sub(lambda m: f"<path>/{m.group(1)}", text)


def why_caught(out: str) -> str:
    """The failed test and its first error lines: a catch a reader can check is the mutation's doing (and not, say,
    a wait that ran out on a busy host)."""
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED ")]
    errors = [ln.strip() for ln in out.splitlines() if ln.startswith("E ")]
    return "\n".join(failed[:1] + errors[:4])[:600]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", type=Path, default=LIST, help="the mutation list (default: tests/mutations.yaml)")
    ap.add_argument("--only", default="", help="comma-separated mutation ids (default: all)")
    ap.add_argument("--repo", type=Path, default=REPO, help="the tree to mutate (default: this repository)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test run (default 900)")
    ap.add_argument("--skip-clean", action="store_true", help="do not check first that the tests pass unmutated")
    ap.add_argument("--lock", type=Path, help="hold an exclusive flock on this file while tests marked slurm or "
                                              "container run (one local Slurm cluster per host)")
    args = ap.parse_args(argv)
    items = load(args.list)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {m["id"] for m in items}
        if unknown:
            raise SystemExit(f"--only: unknown mutation ids {sorted(unknown)}")
        items = [m for m in items if m["id"] in wanted]
    results: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        scratch = Path(tmp) / "tree"
        copy_tree(args.repo.resolve(), scratch)
        every = list(dict.fromkeys(t for m in items for t in m["tests"]))
        locked = marked(scratch, every) if args.lock else set()
        if not args.skip_clean:
            clean_check(scratch, every, locked, args.lock, args.timeout * 2)
        for m in items:
            results.append(run_one(scratch, m, args.lock if locked & set(m["tests"]) else None, args.timeout))
            r = results[-1]
            stale = f"   {r['detail']}" if r["result"] == "error" and not r["seconds"] else ""  # the list, not the run
            print(f"{m['id']:32s} {r['result']:7s} {r['seconds']:6.0f} s {r['cpu_seconds']:6.0f} CPU s{stale}",
                  flush=True)
    caught = sum(r["result"] == "caught" for r in results)
    others = {kind: [r["id"] for r in results if r["result"] == kind] for kind in ("missed", "timeout", "skipped", "error")}
    print(f"caught {caught} of {len(results)}; " + "; ".join(f"{k} {v}" for k, v in others.items()))
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.repo, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=args.repo,
                               capture_output=True, text=True).stdout.strip()
        args.out.write_text(json.dumps(dict(commit=commit + ("+changes" if dirty else ""), caught=caught,
                                            total=len(results), seconds=round(time.monotonic() - started),
                                            cpu_seconds=round(_children_cpu()),
                                            results=results), indent=1) + "\n")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
