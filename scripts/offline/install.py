"""Bring a bare GPU node up from an offline kit, without network (standard library only: it runs before
anything of the kit is installed). ``install_kit.sh`` checks the kit against its manifest and runs this;
a GPU visit (``scripts/gpu/visit.sh``) does the same first.

    python scripts/offline/install.py WHEELS_DIR [TARGET] [--no-build] [--force-build] [--export DIR]
                                      [--jobs N] [--build-timeout S] [--budget-seconds S] [--dry-run]

A kit (``scripts/offline/make_kit.sh DIR ...``) holds, at its top level, the wheels a bare node lacks (torchao,
Transformer Engine's Python part and core library, their small needs, datasets), the
``transformer_engine_torch`` source distribution, and usually a prebuilt ``transformer_engine_torch`` wheel.
install.py puts every wheel into TARGET (default /tmp/site) with ``pip install --no-index --no-deps
--target``, picks the ``transformer_engine_torch`` wheel built for this node's torch, and checks that TE's
PyTorch extension imports, then runs one ``te.Linear`` forward and backward under FP8 current scaling on the
GPU (a pruned or mismatched core library fails there, not minutes later in the first TE run). When no wheel
fits, or the one that should fit does not import, it compiles one from the source distribution, saves it to WHEELS_DIR/built/<key>/ with a build record (and to --export DIR/<key>/,
e.g. under the output folder $OUT), so that the next visit installs it instead of compiling. Last, it prints
the versions block (versions.py).

Which wheel matches this node's torch, and how one is compiled: te_wheel.py.

Inside a command with a time limit (``--budget-seconds``, scripts/gpu/visit.sh), every wait is cut to what is left:
the pip install, each check (TE's import, its kernels: at most CHECK_S each), the compile (at most half the budget,
and --build-timeout), the versions block. A later run into the same TARGET whose kit (its MANIFEST.json), chosen TE
extension, Python and torch are those of the install there reuses it: only TE's import is checked again.

Use TARGET with ``export PYTHONPATH=TARGET:$REPO/src``. Exit codes: 0 ready; 2 bad arguments or an unusable
kit (the message names the missing or conflicting wheel); 3 TE's PyTorch extension is not usable (it does not
import and was not compiled, the compile failed, or its kernels do not run): torchao and the HF model still work.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import node_checks as nc  # in this folder
from kit import sha256
from node_checks import (
    EXIT_BAD_KIT,
    EXIT_NO_TE,
    NO_ANSWER,
    InstallError,
    child_env,
    import_check,
    kernel_check,
    say,
    torch_versions,
    versions_block,
)
from te_wheel import (  # in this folder
    BUILT_DIR,
    TE_TORCH,
    Choice,
    Kit,
    build_plan,
    build_record,
    choose_te_torch,
    describe,
    inventory,
    normalize,
    problems,
    record_path,
    run_bounded,
    save_build,
)

HERE = Path(__file__).resolve().parent
MARKER = ".llama-fp8-install"  # written into TARGET: only a folder holding it is ever emptied; what it holds


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="install.py", description=__doc__.splitlines()[0])
    p.add_argument("wheels_dir", metavar="WHEELS_DIR", help="the offline kit (scripts/offline/make_kit.sh DIR)")
    p.add_argument("target", metavar="TARGET", nargs="?", default="/tmp/site",
                   help="folder to install into (default /tmp/site); emptied first if an earlier install.py made it")
    p.add_argument("--no-build", action="store_true", help="never compile transformer_engine_torch (exit 3 instead)")
    p.add_argument("--force-build", action="store_true", help="compile transformer_engine_torch even if a wheel fits")
    p.add_argument("--export", metavar="DIR", help="also copy a freshly built wheel and its record to DIR/<key>/")
    p.add_argument("--jobs", type=int, help="parallel compile jobs (MAX_JOBS; default: the CPU cores)")
    p.add_argument("--build-timeout", type=float, default=480.0, help="seconds the compile may take (default 480)")
    p.add_argument("--budget-seconds", type=float, help="the whole install's time: every wait is cut to what is left, "
                   "the compile to half of it")
    p.add_argument("--dry-run", action="store_true",
                   help="print the install and build commands (with their environment) and change nothing")
    args = p.parse_args(argv)
    if args.no_build and args.force_build:
        p.error("--no-build and --force-build contradict each other")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs {args.jobs}: must be >= 1")
    if args.budget_seconds is not None and args.budget_seconds <= 0:
        p.error(f"--budget-seconds {args.budget_seconds}: must be > 0")
    return args


@dataclass(frozen=True)
class Node:
    cp_tag: str
    machine: str
    torch: str | None
    cuda: str | None
    installed: frozenset[str]


def node_info() -> Node:
    """This Python: its tag, machine, torch (the one TE's extension must match) and packages."""
    torch_version, cuda = torch_versions()
    names = frozenset(normalize(d.metadata["Name"] or "") for d in importlib.metadata.distributions())
    return Node(f"cp{sys.version_info[0]}{sys.version_info[1]}", platform.machine(), torch_version, cuda, names)


def install_command(wheels: list[Path], target: Path) -> list[str]:
    # One pip call for all wheels: transformer_engine and transformer_engine_torch share the
    # transformer_engine/ folder, and a second --target install would replace that folder whole.
    return [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", str(target), *map(str, wheels)]


def prepare_target(target: Path) -> None:
    """Empty TARGET if an earlier install.py made it; refuse a non-empty folder it did not make."""
    if target.exists() and any(target.iterdir()):
        if not (target / MARKER).is_file():
            raise InstallError(f"TARGET {target} is not empty and was not made by install.py (no {MARKER}): "
                                 f"choose an empty or new folder", EXIT_BAD_KIT)
        shutil.rmtree(target)
    target.mkdir(parents=True, exist_ok=True)
    (target / MARKER).write_text("made by scripts/offline/install.py; emptied by its next run\n")


def install(wheels: list[Path], target: Path) -> None:
    prepare_target(target)
    say(f"installing {len(wheels)} wheels into {target}")
    t0 = time.perf_counter()
    limit = nc.CLOCK.bound(600, "the pip install", EXIT_BAD_KIT)
    try:
        proc = run_bounded(install_command(wheels, target), limit, child_env(target))
    except subprocess.TimeoutExpired:
        raise InstallError(f"the pip install took more than {limit:.0f} s (--budget-seconds)", EXIT_BAD_KIT) from None
    if proc.returncode != 0:
        raise InstallError(f"pip install failed ({proc.returncode}):\n{proc.stdout[-6000:]}",
                             EXIT_BAD_KIT)
    say(f"installed in {time.perf_counter() - t0:.1f} s")


def compile_problems(bp, kit: Kit) -> list[str]:
    """The compile's missing prerequisites, less the cuDNN frontend when the kit brings it (installed before the
    compile; a dry run's probe cannot see it yet)."""
    has = bool(kit.find("nvidia_cudnn_frontend"))
    return [p for p in bp.problems if not (has and "nvidia-cudnn-frontend" in p)]


def compile_timeout(build_timeout: float) -> float:
    """--build-timeout, and at most half of what is left of --budget-seconds: the runs after it need the rest."""
    left = nc.CLOCK.left()
    return nc.CLOCK.bound(build_timeout if left is None else min(build_timeout, left / 2), "a compile")


def build(kit: Kit, te_version: str, node: Node, target: Path, args: argparse.Namespace) -> Path:
    """Compile transformer_engine_torch into WHEELS_DIR/built/<key>/ (and --export); returns the wheel."""
    out_dir = Path(tempfile.mkdtemp(prefix="te-torch-wheel-"))
    timeout = compile_timeout(args.build_timeout)
    bp = build_plan(sys.executable, kit.sdist, out_dir, target, args.jobs, dict(os.environ),
                    probe_s=nc.CLOCK.bound(60, "the compile's probe"))
    if compile_problems(bp, kit):
        raise InstallError("cannot compile transformer_engine_torch:\n  " + "\n  ".join(compile_problems(bp, kit)),
                           EXIT_NO_TE)
    log = out_dir.with_suffix(".log")
    say(f"compiling {kit.sdist.name} against torch {node.torch} (MAX_JOBS={bp.env['MAX_JOBS']}, up to "
        f"{timeout:.0f} s; log {log})")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(bp.command, env={**os.environ, **bp.env}, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise InstallError(f"the compile took more than {timeout:.0f} s and was stopped (--build-timeout, or half "
                               f"of --budget-seconds); log {log}", EXIT_NO_TE) from None
    built = sorted(out_dir.glob(f"{TE_TORCH}-*.whl"))
    if rc != 0 or not built:
        raise InstallError(f"the compile failed (exit {rc}); last lines of {log}:\n"
                             + log.read_text()[-3000:], EXIT_NO_TE)
    seconds = time.perf_counter() - t0
    rec = build_record(te_version, node.torch, node.cp_tag, node.cuda, bp, seconds)
    dest = save_build(built[0], kit.root, rec)
    say(f"compiled in {seconds:.0f} s; kept as {dest}")
    if args.export:
        export = Path(args.export) / dest.parent.name
        export.mkdir(parents=True, exist_ok=True)
        for f in (dest, record_path(dest)):
            shutil.copy2(f, export / f.name)
        say(f"copied to {export} (bring it back into {kit.root / BUILT_DIR}/)")
    return dest


def check_kit(args: argparse.Namespace) -> tuple[Kit, Node, str]:
    root = Path(args.wheels_dir).resolve()
    if not root.is_dir():
        raise InstallError(f"WHEELS_DIR {args.wheels_dir}: not a folder (make a kit with "
                             f"scripts/offline/make_kit.sh {args.wheels_dir} --python X.Y --torch V --arch sm_NN)", EXIT_BAD_KIT)
    try:
        kit = inventory(root)
    except ValueError as e:
        raise InstallError(str(e), EXIT_BAD_KIT) from None
    node = node_info()
    issues = problems(kit, set(node.installed))
    if node.torch is None:
        issues.append(f"this Python ({sys.executable}) has no torch: run install.py with the node's PyTorch Python")
    if issues:
        raise InstallError("the kit cannot be used:\n  " + "\n  ".join(issues), EXIT_BAD_KIT)
    te_version = kit.te_version() or importlib.metadata.version("transformer_engine")
    return kit, node, te_version


MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def missing_module(import_error: str) -> str | None:
    """The module a failed import check could not find, unless it is TE's own extension (which a compile makes)."""
    found = MISSING_MODULE.findall(import_error)
    if not found or found[-1].split(".")[0] in (TE_TORCH, "transformer_engine"):
        return None
    return found[-1]


def install_te(kit: Kit, wheels: list[Path], choice: Choice, te_version: str, node: Node, target: Path,
               args: argparse.Namespace) -> None:
    """Install the kit with the chosen TE extension; compile one when it does not import (unless --no-build)."""
    ok, message = False, "no wheel chosen"
    if choice.wheel is not None:
        install([*wheels, choice.wheel.path], target)
        ok, message = import_check(target)
        say(("TE: " if ok else "TE does not import with this wheel: ") + message)
    if ok:
        return
    if NO_ANSWER in message:  # a slow or hung import: a compile would not answer it either, and has no time
        raise InstallError(f"{message}: TE is not used in this command (no compile tried)", EXIT_NO_TE)
    missing = missing_module(message)
    if missing is not None:  # a compile builds TE's extension only: it cannot bring a Python module
        raise InstallError(f"TE does not import: it needs the Python module {missing!r}, which this node lacks; "
                           f"carry its wheel in the kit (and its own needs): compiling would not help", EXIT_NO_TE)
    if args.no_build:
        raise InstallError("transformer_engine_torch is not usable and --no-build was given", EXIT_NO_TE)
    if kit.sdist is None:
        raise InstallError(f"no {TE_TORCH}-{te_version}.tar.gz in the kit to compile", EXIT_NO_TE)
    install(wheels, target)  # the build finds TE's core and cudnn-frontend headers here
    dest = build(kit, te_version, node, target, args)
    install([*wheels, dest], target)
    ok, message = import_check(target)
    if not ok:
        raise InstallError(f"the compiled {dest.name} does not import either:\n{message}", EXIT_NO_TE)
    say("TE: " + message)


def run(args: argparse.Namespace) -> int:
    nc.CLOCK = nc.Clock(args.budget_seconds)
    kit, node, te_version = check_kit(args)
    target = Path(args.target).resolve()
    say(f"kit {kit.root}: {len(kit.wheels)} wheels, TE {te_version}; node: {node.cp_tag}, torch {node.torch}")
    choice = Choice(None, False, ()) if args.force_build else choose_te_torch(
        kit, te_version, node.torch, node.cp_tag, node.machine)
    for note in choice.notes:
        say(f"not used: {note}")
    if choice.wheel is not None:
        how = "built for this torch (build record)" if choice.recorded else "no build record: kept only if it imports"
        say(f"{TE_TORCH}: {choice.wheel.path.relative_to(kit.root)} ({how})")
    elif kit.sdist is None:
        raise InstallError(f"no {TE_TORCH} wheel fits torch {node.torch} / {node.cp_tag} and the kit "
                             f"has no {TE_TORCH}-{te_version}.tar.gz to compile one", EXIT_BAD_KIT)
    wheels = [w.path for w in kit.wheels]
    if args.dry_run:
        return dry_run(kit, wheels, choice, target, args)
    fp = fingerprint(kit, choice, node)
    if not args.force_build and reuse(target, fp):
        return 0
    try:
        install_te(kit, wheels, choice, te_version, node, target, args)
        ok, message = kernel_check(target)
        if not ok:  # the extension imports, its kernels fail (e.g. a core library without this GPU's code)
            raise InstallError(f"TE imports but its kernels do not run on this GPU:\n{message}", EXIT_NO_TE)
        say("TE kernels: " + message)
        mark(target, fp, message)
    except InstallError as e:  # the wheels are in, TE is not usable: a second command reuses them, TE checked again
        if e.code == EXIT_NO_TE and (target / MARKER).is_file():
            mark(target, fp, None, str(e).splitlines()[0][:300])
        raise
    finally:  # the versions block, also when TE is not usable: what the node has is worth knowing then too
        versions_block(target)
    say(f"ready: export PYTHONPATH={target}:$REPO/src")
    return 0


def fingerprint(kit: Kit, choice: Choice, node: Node) -> dict:
    """What an install is of: the kit (its MANIFEST.json, else its wheels' names and sizes), the TE extension chosen,
    this Python and torch."""
    manifest = kit.root / "MANIFEST.json"
    files = sha256(manifest) if manifest.is_file() else sorted(
        f"{w.path.name}:{w.path.stat().st_size}" for w in [*kit.wheels, *kit.te_torch])
    return {"kit": files, "te_torch": choice.wheel.path.name if choice.wheel else None, "python": node.cp_tag,
            "torch": node.torch}


def mark(target: Path, fp: dict, kernels: str | None, te_unusable: str = "") -> None:
    """After a whole install: what it was of and whether TE ran, in TARGET's marker (reuse reads it)."""
    (target / MARKER).write_text(json.dumps({"made_by": "scripts/offline/install.py", "fingerprint": fp,
                                             "kernels": kernels, "te_unusable": te_unusable}) + "\n")


def reuse(target: Path, fp: dict) -> bool:
    """TARGET holds a whole install of this very kit for this Python and torch, and TE still imports from it: use it
    (a second command on the same node keeps its time for measuring). False: install afresh."""
    try:
        done = json.loads((target / MARKER).read_text()[:100_000])
    except (OSError, ValueError):
        return False
    if not isinstance(done, dict) or done.get("fingerprint") != fp:
        return False
    ok, message = import_check(target)
    if not ok and not done.get("te_unusable"):
        say(f"{target}: installed from this kit, but TE does not import there now: installing again")
        return False
    say(f"reused the install in {target} (same kit, TE extension, Python and torch)")
    try:
        if not ok:  # TE was not usable when installed either: the wheels stay, the runs go on without TE
            raise InstallError(f"TE was not usable in that install ({done['te_unusable']}) and is not now: "
                               f"{message}", EXIT_NO_TE)
        say(f"TE: {message}; TE kernels (when installed): {done.get('kernels') or 'not run: TE did not import then'}")
    finally:
        versions_block(target)
    say(f"ready: export PYTHONPATH={target}:$REPO/src")
    return True


def dry_run(kit: Kit, wheels: list[Path], choice: Choice, target: Path,
            args: argparse.Namespace) -> int:
    import shlex

    chosen = [choice.wheel.path] if choice.wheel is not None else []
    say("dry run: would run\n" + " ".join(map(shlex.quote, install_command([*wheels, *chosen], target))))
    if choice.wheel is None or args.force_build:
        bp = build_plan(sys.executable, kit.sdist, Path(tempfile.gettempdir()) / "te-torch-wheel", target,
                               args.jobs, dict(os.environ))
        say("dry run: then compile with\n" + describe(bp))
        for problem in compile_problems(bp, kit):
            say(f"dry run: the compile would fail now: {problem}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except InstallError as e:
        print(f"[install] error: {e}", file=sys.stderr, flush=True)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
