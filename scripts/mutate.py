#!/usr/bin/env python3
"""Mutation check of the test suite: does each behaviour we claim to test still get caught?

    .venv/bin/python scripts/mutate.py                     # every mutation in tests/mutations.yaml
    .venv/bin/python scripts/mutate.py --only exit-requeue # one (or a comma list)
    .venv/bin/python scripts/mutate.py --out tests/mutations-result.json

Each mutation is one small edit of the code (a threshold, an exit code, a sign, a skipped check, a dropped flush)
and the tests that must catch it. The script copies the tree (the files git knows, plus untracked ones it does not
ignore) to a scratch folder, checks that the listed tests pass there unmutated, then for each mutation applies the
edit to the scratch copy only, runs only its tests, and reports caught (a test failed) or missed (all passed).
The tree itself is never edited. The tests run with this interpreter and the scratch copy's src/ first on
PYTHONPATH, so in-process imports and the subprocesses the tests start both see the mutated code.

A mutation's `old` text must occur exactly once in its file (else the list is stale: an error, not a miss).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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


def apply(scratch: Path, m: dict) -> str:
    """Apply mutation m in the scratch copy; return the file's original text (to restore it)."""
    path = scratch / m["file"]
    text = path.read_text()
    n = text.count(m["old"])
    if n != 1:
        raise LookupError(f"{m['file']}: the text to mutate occurs {n} times (expected once): {m['old']!r}")
    path.write_text(text.replace(m["old"], m["new"], 1))
    return text


def run_tests(scratch: Path, tests: list[str], timeout: float) -> tuple[int, float, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(scratch / "src"), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=--strict-markers",
           *tests]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -1, time.monotonic() - t0, out[-2000:] + f"\n(timed out after {timeout:.0f} s)"
    return proc.returncode, time.monotonic() - t0, (proc.stdout + proc.stderr)[-2000:]


def verdict(rc: int) -> str:
    """pytest's exit codes: 0 all passed (missed), 1 a test failed (caught), a timeout (-1) counts as caught (the
    mutation made a test hang: its timeout catches it); 2-5 mean the run itself was broken: an error."""
    return {0: "missed", 1: "caught", -1: "caught"}.get(rc, "error")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", type=Path, default=LIST, help="the mutation list (default: tests/mutations.yaml)")
    ap.add_argument("--only", default="", help="comma-separated mutation ids (default: all)")
    ap.add_argument("--repo", type=Path, default=REPO, help="the tree to mutate (default: this repository)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test run (default 900)")
    ap.add_argument("--skip-clean", action="store_true", help="do not check first that the tests pass unmutated")
    args = ap.parse_args(argv)
    items = load(args.list)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {m["id"] for m in items}
        if unknown:
            raise SystemExit(f"--only: unknown mutation ids {sorted(unknown)}")
        items = [m for m in items if m["id"] in wanted]
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        scratch = Path(tmp) / "tree"
        copy_tree(args.repo.resolve(), scratch)
        if not args.skip_clean:
            tests = list(dict.fromkeys(t for m in items for t in m["tests"]))
            rc, secs, out = run_tests(scratch, tests, args.timeout * 2)
            print(f"clean run of {len(tests)} test ids: rc {rc} in {secs:.0f} s", flush=True)
            if rc != 0:
                print(out, file=sys.stderr)
                raise SystemExit("the listed tests do not pass on the unmutated tree: fix that first")
        for m in items:
            try:
                original = apply(scratch, m)
            except LookupError as e:
                results.append(dict(id=m["id"], result="error", seconds=0.0, detail=str(e)))
                print(f"{m['id']:32s} error   {e}", flush=True)
                continue
            try:
                rc, secs, out = run_tests(scratch, m["tests"], args.timeout)
            finally:
                (scratch / m["file"]).write_text(original)
            res = verdict(rc)
            results.append(dict(id=m["id"], result=res, seconds=round(secs, 1),
                                detail="" if res == "caught" else out[-800:]))
            print(f"{m['id']:32s} {res:7s} {secs:6.0f} s", flush=True)
    caught = sum(r["result"] == "caught" for r in results)
    print(f"caught {caught} of {len(results)}; missed {[r['id'] for r in results if r['result'] == 'missed']}; "
          f"errors {[r['id'] for r in results if r['result'] == 'error']}")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.repo, capture_output=True,
                                text=True).stdout.strip()
        args.out.write_text(json.dumps(dict(commit=commit, caught=caught, total=len(results), results=results),
                                       indent=1) + "\n")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
