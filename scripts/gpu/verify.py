"""Verify the package on a GPU node in slices that each fit one command's budget, resumable across commands.

    python scripts/gpu/verify.py [--plan first|all] [--only STEP,...] [--match GLOB]... [--budget-seconds S]
                                 [--merge-from FILE] [--rehearse] [--list] [--dry-run]

Runs units.py's units in order, one record per unit (per test for pytest) appended as each ends; a unit with a final
record for this GPU and versions key is skipped, so the same command goes on where the last stopped. No unit starts
with less of --budget-seconds left than its estimate; a running one is cut at the budget's end (``interrupted``).
--rehearse runs the plan on CPU (units.rehearsal_twin); its records go to WORK/rehearsal.jsonl.

Exit codes: 0 every selected unit is recorded; 10 the budget ran out first (run again); 2 bad arguments;
3 the versions probe failed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "scripts" / "offline"))  # the versions block and the install's offline settings

import memory  # noqa: E402
import runs  # noqa: E402
import steps  # noqa: E402
import units  # noqa: E402
import versions  # noqa: E402
from te_wheel import OFFLINE_ENV  # noqa: E402

EXIT_MORE, EXIT_VERSIONS = 10, 3


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="verify.py", description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="all", choices=units.PLANS, help="first: one visit, by value; all: then the rest")
    p.add_argument("--only", help=f"comma-separated steps to run: {','.join(units.STEPS)}")
    p.add_argument("--match", action="append", metavar="GLOB", help="only units whose id matches (repeatable)")
    p.add_argument("--budget-seconds", type=float, help="start no unit that would not fit; cut one at the end")
    p.add_argument("--results", help="the results file (default docs/gpu-results/results.jsonl; --rehearse: WORK/)")
    p.add_argument("--merge-from", metavar="FILE", help="first append the records of FILE the results file lacks")
    p.add_argument("--mirror", default=os.environ.get("OUT"), help="copy results and logs here after each unit ($OUT)")
    p.add_argument("--work", default="/tmp/llama-fp8-verify", help="run dirs and logs")
    p.add_argument("--python", default=sys.executable, help="the Python that runs pytest and the trainer")
    p.add_argument("--retry", action="store_true", help="run again the units whose last record failed or timed out")
    p.add_argument("--list", action="store_true", help="print each selected unit with its status and exit")
    p.add_argument("--rehearse", action="store_true", help="on CPU: training cells as their CPU twins")
    d = units.Options()
    p.add_argument("--device", default=d.device, choices=("cuda", "cpu"), help="--device of the training runs")
    p.add_argument("--models", default=",".join(d.models), help=f"matrix models: {', '.join(units.MODELS)} or presets")
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="steps of a training cell")
    p.add_argument("--warmup-steps", type=int, default=d.warmup, help="first steps left out of the timing")
    p.add_argument("--logging-freq", type=int, default=d.logging_freq, help="--logging_freq of the runs")
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        p.error(problem)
    return args


def check_args(args: argparse.Namespace) -> str | None:
    bad = [s for s in (args.only or "").split(",") if s and s not in units.STEPS]
    if bad:
        return f"--only {','.join(bad)}: not a step; valid: {', '.join(units.STEPS)}"
    presets = {p.stem for p in (REPO / "src" / "llama_fp8" / "configs").glob("*.yaml")}
    bad = [m for m in args.models.split(",") if m not in units.MODELS and m not in presets]
    if bad:
        return f"--models {','.join(bad)}: valid: {', '.join(units.MODELS)} or a preset ({', '.join(sorted(presets))})"
    for name in ("max_steps", "logging_freq"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1"
    if not 0 <= args.warmup_steps < args.max_steps:
        return f"--warmup-steps {args.warmup_steps}: must be >= 0 and below --max-steps"
    if args.budget_seconds is not None and args.budget_seconds <= 0:
        return f"--budget-seconds {args.budget_seconds}: must be > 0"
    return None


def child_env(work: Path) -> dict[str, str]:
    env = {**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(work / "hf_datasets"), "HF_HOME": str(work / "hf_home")}
    # not scripts/gpu: its plain module names (runs, units, ...) must not shadow packages; pytest adds it
    paths = [str(REPO / "src"), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def provenance() -> dict:
    """Which code measured: a hash of src/ (the device copy has no .git) and the git commit when there is one."""
    h = hashlib.sha256()
    for path in sorted((REPO / "src").rglob("*")):
        if path.is_file() and path.suffix in (".py", ".yaml"):
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    out = {"src_sha": h.hexdigest()[:12]}
    try:
        out["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


def probe_versions(args: argparse.Namespace, work: Path, env: dict[str, str], budget: runs.Budget) -> dict:
    path = work / "versions.json"
    path.unlink(missing_ok=True)
    out = runs.timebox([args.python, versions.__file__, "--json", str(path)], budget.limit(180)[0],
                       work / "logs" / "versions.log", env, REPO)
    if out.returncode != 0 or not path.is_file():
        raise SystemExit(f"verify: the versions probe failed ({out.returncode}):\n{out.tail()}")
    found = json.loads(path.read_text())
    print(versions.format_block(found), flush=True)
    return found


def bundle_logs(work: Path, mirror: Path | None) -> None:
    """logs/ (with nvidia-smi's samples of each run) and every run's metrics.jsonl and config.yaml, as one archive
    (few files for the output folder)."""
    if mirror is None:
        return
    mirror.mkdir(parents=True, exist_ok=True)
    tmp = mirror / "logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for pattern in ("logs/*.log", "logs/*.smi.csv", "runs/**/metrics.jsonl", "runs/**/config.yaml"):
            for path in sorted(work.glob(pattern)):
                tar.add(path, arcname=str(path.relative_to(work)))
    tmp.replace(mirror / "logs.tar.gz")


RUNNERS = {"pytest": steps.run_pytest, "train": steps.run_train, "memory": memory.run_memory,
           "estimate": memory.run_estimate}


def list_units(selected: list[units.Unit], records: list[dict], key: str, gpu: str, which: str) -> None:
    """Each unit with its status and estimate; for the first plan, which command it falls in and the visit's
    budget (units.first_visit)."""
    last = {r["unit"]: r["status"] for r in records if r.get("key") == key and "unit" in r
            and (r.get("kind") not in runs.MEASURED or r.get("gpu") == gpu)}
    budget = units.first_visit() if which == "first" else None
    command = {u.id: i for i, c in enumerate(budget.commands, 1) for u in c} if budget else {}
    for u in selected:
        where = f"  [command {command[u.id]}]" if u.id in command else ("  [a later visit]" if budget else "")
        print(f"{last.get(u.id, 'pending'):<12} ~{u.estimate_s:>4.0f}s  {u.id}{where}")
    if budget:
        print("\n".join(budget.lines()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    work = Path(args.work).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    mirror = Path(args.mirror).resolve() if args.mirror else None
    default = work / "rehearsal.jsonl" if args.rehearse else REPO / "docs" / "gpu-results" / "results.jsonl"
    store = runs.Store(Path(args.results or default).resolve(), mirror)
    if args.merge_from and Path(args.merge_from).is_file():
        runs.merge(Path(args.merge_from), store.path)
    budget = runs.Budget(args.budget_seconds)
    env = child_env(work)
    try:
        found = probe_versions(args, work, env, budget)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return EXIT_VERSIONS
    key, gpu = found["key"], found["gpu"]
    stamp = {**provenance(), "gpu": gpu, "driver": found.get("driver"),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    opts = units.Options(device="cpu" if args.rehearse else args.device, models=tuple(args.models.split(",")),
                         max_steps=args.max_steps, warmup=args.warmup_steps, logging_freq=args.logging_freq,
                         rehearse=args.rehearse)
    only = tuple(s for s in (args.only or "").split(",") if s) or None
    selected = units.select(units.plan(opts, args.plan), only, tuple(args.match) if args.match else None)
    records = store.records()
    if args.list:
        list_units(selected, records, key, gpu, args.plan)
        return 0
    ctx = runs.Context(REPO, work, args.python, store, key, gpu, opts, env, budget, mirror, args.retry)
    pending = [u for u in selected if u.id not in runs.done(records, key, args.retry, gpu)]
    if args.rehearse:
        print("[verify] rehearsal on CPU: training cells as their CPU twins; GPU tests skip; no CUDA", flush=True)
    if not any(r.get("key") == key and r.get("gpu") == gpu and r.get("unit") == "versions" for r in records):
        store.append({"key": key, "unit": "versions", "kind": "versions", "status": "passed", "versions": found,
                      **stamp})
    print(f"[verify] key {key} on {gpu}: {len(pending)} of {len(selected)} selected units to run", flush=True)
    store.copy_to_mirror()
    return run_units(ctx, pending, stamp)


def run_units(ctx: runs.Context, pending: list[units.Unit], stamp: dict) -> int:
    started = 0
    for unit in pending:
        left = ctx.budget.left()
        if started and left is not None and left < unit.estimate_s:
            print(f"[verify] budget: {left:.0f} s left, {unit.id} needs ~{unit.estimate_s:.0f} s: stopping here "
                  f"(run the same command again to continue)", flush=True)
            return EXIT_MORE
        started += 1
        print(f"[verify] {unit.id} ...", flush=True)
        t0 = time.monotonic()
        fields = RUNNERS[unit.step](ctx, unit)
        rec = ctx.store.append({"key": ctx.key, "unit": unit.id, "kind": unit.step, **stamp, **fields,
                                "seconds": round(time.monotonic() - t0, 1)})
        print(f"[verify] {unit.id}: {rec['status']} in {rec['seconds']:.0f} s"
              + (f"\n{rec['message'][-800:]}" if rec.get("message") and rec["status"] != "passed" else ""), flush=True)
        bundle_logs(ctx.work, ctx.mirror)
        if rec["status"] == "interrupted":
            return EXIT_MORE
    return 0


if __name__ == "__main__":
    sys.exit(main())
