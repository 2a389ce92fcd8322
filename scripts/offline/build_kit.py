"""Build an offline kit for an air-gapped GPU node: ``make_kit.sh`` runs this (the one builder).

    python scripts/offline/build_kit.py DIR --python 3.12 --torch 2.11.0 --arch sm_90 [--platform x86_64|aarch64]
        [--te 2.20.2|none] [--torchao 0.18.0] [--pydantic 2.14.4] [--cuda 13] [--with GROUP] [--without GROUP]
        [--te-torch-wheel WHEEL] [--build-te] [--record FILE] [--dry-run]

Every wheel comes through the index pip is configured with (``pip download --only-binary=:all:`` for the node's
Python and platform, from any machine); TE's torch extension source through pip's own finder (``pip download``
would build the sdist's metadata first, which needs a CUDA torch); TE's core wheel is unpacked with ``zipfile``,
its library pruned to the node's GPU (``kit.prune``), and repacked with its RECORD updated. pydantic and
pydantic_core are pinned as the pair pydantic's own metadata names (a pydantic with another pydantic_core
refuses to import). A wheel that does not exist for the platform is named with what to do instead (TE on
arm64: the NGC image's). The kit is built beside DIR and moved in whole: an interrupted build leaves DIR as it
was. ``--record FILE`` writes each file's size and the total with this repository's working tree (what a
command to the node carries), checked against the 60 MiB budget.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import kit
import wheelzip
from kit import repo_bytes, size_table  # noqa: F401 - the record's parts, tests use them here
from te_wheel import find_cuda_home, find_python

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUDGET_BYTES = 60 * 2**20  # the kit and the working tree, inside the 64 MiB a command to the node carries
PLATFORMS = {  # pip's platform tags, newest first (manylinux_2_28 is what TE's core wheels are built for)
    "x86_64": ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
               "manylinux2014_x86_64"),
    "aarch64": ("manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_26_aarch64",
                "manylinux_2_24_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"),
}
TE_ON_ARM = ("on arm64 use the Transformer Engine of the NGC PyTorch image (0.transformer-engine.dockerfile "
             "--platform linux/arm64): TE publishes no CUDA 13 aarch64 wheels of some releases "
             "(NVIDIA/TransformerEngine#3309) and no prebuilt aarch64 torch extension (#3310)")


@dataclass(frozen=True)
class Group:
    name: str
    why: str
    specs: tuple[str, ...]
    default: bool


# What a bare node (CUDA torch, transformers, numpy, packaging; no TE) lacks. TE's core library and its torch
# extension's source come separately (pruned, and through pip's finder); pydantic's own needs from its metadata.
GROUPS = (
    Group("base", "torchao, TE's Python part, pydantic (TE's recipes are pydantic dataclasses), TE's debug API",
          ("torchao=={torchao}", "transformer_engine=={te}", "pydantic=={pydantic}", "nvdlfw-inspect"), True),
    Group("onnx", "what `import transformer_engine.pytorch` (2.20) also imports: onnx, onnxscript, einops",
          ("onnx", "onnxscript", "onnx_ir", "ml_dtypes", "protobuf", "einops"), True),
    Group("cudnn-frontend", "cuDNN frontend headers: only to compile TE's torch extension on the node",
          ("nvidia-cudnn-frontend",), False),
    Group("datasets", "the real-text data pipeline (datasets and the needs a torch image lacks)",
          ("datasets", "dill", "multiprocess"), False),
    Group("s3", "s3:// checkpoints: the Amazon S3 Connector for PyTorch, its client and its [dcp] extra's tenacity",
          ("s3torchconnector==1.5.0", "s3torchconnectorclient==1.5.0", "tenacity"), False),
)
NO_TE_SPECS = ("transformer_engine==", "nvdlfw-inspect")  # with --te none: no TE part at all


class BuildError(Exception):
    """A user-facing error: printed, exit code 2."""


def say(text: str) -> None:
    print(f"[make_kit] {text}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="make_kit.sh", description=__doc__.splitlines()[0])
    p.add_argument("dir", metavar="DIR", help="the kit folder: new, or a kit made here (has MANIFEST.json)")
    p.add_argument("--python", required=True, help="the node's Python as major.minor, e.g. 3.12")
    p.add_argument("--torch", required=True, help="the node's torch version, e.g. 2.11.0")
    p.add_argument("--arch", action="append", required=True, help="the node's GPU: sm_90 (H100/H200), sm_100 (B200)")
    p.add_argument("--platform", default="x86_64", choices=tuple(PLATFORMS), help="the node's CPU (GB200: aarch64)")
    p.add_argument("--te", default="2.20.2", help="Transformer Engine version, or none (use the node's or image's)")
    p.add_argument("--torchao", default="0.18.0")
    p.add_argument("--pydantic", default="2.14.4", help="pydantic; its pydantic_core is the one it pins")
    p.add_argument("--cuda", default="13", choices=("12", "13"), help="CUDA major of TE's core wheel (the node's torch)")
    names = [g.name for g in GROUPS if g.name != "base"]
    p.add_argument("--with", dest="add", action="append", default=[], choices=names, help="an optional group")
    p.add_argument("--without", dest="drop", action="append", default=[], choices=names, help="leave a group out")
    p.add_argument("--te-torch-wheel", help="a transformer_engine_torch wheel compiled for the node's torch")
    p.add_argument("--build-te", action="store_true", help="compile TE's torch extension here for the node's torch")
    p.add_argument("--record", help="write the kit's sizes and the total with this repository to FILE (JSON)")
    p.add_argument("--dry-run", action="store_true", help="print each step and change nothing")
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        p.error(problem)
    return args


def check_args(a: argparse.Namespace) -> str | None:
    if not re.fullmatch(r"3\.\d+", a.python):
        return f"--python {a.python!r}: expected the node's Python as major.minor, e.g. 3.12"
    if not re.fullmatch(r"\d+\.\d+\.\d+", a.torch):
        return f"--torch {a.torch!r}: expected the node's torch version, e.g. 2.11.0"
    for arch in a.arch:
        if not re.fullmatch(r"sm_\d{2,3}a?", arch):
            return f"--arch {arch!r}: expected sm_NN as in nvcc, e.g. sm_90 (H100/H200) or sm_100 (B200)"
    for flag in ("te", "torchao", "pydantic"):
        value = getattr(a, flag)
        if not re.fullmatch(r"\d[0-9A-Za-z.+-]*", value) and not (flag == "te" and value == "none"):
            return f"--{flag} {value!r}: expected a version, e.g. 2.20.2" + (", or none" if flag == "te" else "")
    both = set(a.add) & set(a.drop)
    if both:
        return f"--with and --without both name {', '.join(sorted(both))}"
    if a.te == "none" and (a.te_torch_wheel or a.build_te):
        return "--te none leaves TE out: --te-torch-wheel and --build-te need a TE version"
    if a.te_torch_wheel and a.build_te:
        return "--te-torch-wheel and --build-te both give TE's torch extension: give one"
    if a.te_torch_wheel:  # checked before anything is downloaded: this TE, this Python, this platform
        src, cp = Path(a.te_torch_wheel), "cp" + a.python.replace(".", "")
        want = rf"transformer_engine_torch-{re.escape(a.te)}-{cp}-{cp}-[A-Za-z0-9_.]*{a.platform}\.whl"
        if not src.is_file() or not re.fullmatch(want, src.name):
            return (f"--te-torch-wheel {src}: expected a file transformer_engine_torch-{a.te}-{cp}-{cp}-linux_"
                    f"{a.platform}.whl (TE {a.te}, Python {a.python}, {a.platform})")
    if a.build_te and a.platform != host_platform():
        return (f"--build-te compiles for this machine's CPU ({host_platform()}), not {a.platform}: compile on the "
                f"node (install.py does) or give --te-torch-wheel" + (f"; {TE_ON_ARM}" if a.platform == "aarch64" else ""))
    return None


def host_platform() -> str:
    import platform

    return platform.machine()


def pip_download(python: str, platform: str, dest: Path, specs: list[str], dry: bool) -> str | None:
    """Download ``specs`` (no dependencies) for the node's Python and platform; returns pip's error or None."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", *[x for tag in PLATFORMS[platform] for x in ("--platform", tag)],
           "-d", str(dest), *specs]
    if dry:
        print(" ".join(cmd))
        return None
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    lines = [x for x in (proc.stderr + proc.stdout).splitlines() if x.startswith("ERROR")]
    return "\n".join(lines) or (proc.stderr + proc.stdout)[-1500:]


def download_group(args: argparse.Namespace, specs: list[str], dest: Path) -> dict[str, str]:
    """One pip call for ``specs``; when pip finds no wheel for one of them on this platform, that one is set aside
    (named with pip's error) and the call repeated for the rest. Returns {spec: why it is missing}; any other
    failure of pip (the network, the index) is an error."""
    missing, left = {}, list(specs)
    while left:
        error = pip_download(args.python, args.platform, dest, left, args.dry_run)
        if error is None:
            return missing
        found = re.search(r"No matching distribution found for (\S+)", error)
        spec = next((s for s in left if found and _name(s) == _name(found.group(1))), None)
        if spec is None:
            raise BuildError(f"pip download failed ({args.platform}, Python {args.python}):\n{error}")
        missing[spec] = error
        left.remove(spec)
    return missing


def _name(spec: str) -> str:
    return re.sub(r"[-_.]+", "_", re.split(r"[<>=!~ ;\[]", spec, maxsplit=1)[0]).lower()


def requirements(wheel: Path) -> list[str]:
    """The unconditional Requires-Dist lines of a wheel's METADATA (extras and markers left out)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [v.strip().replace(" ", "") for k, v in (line.split(":", 1) for line in text.splitlines()
            if line.startswith("Requires-Dist:")) if ";" not in v]


def fetch_sdist(name: str, version: str, dest: Path) -> Path:
    """The sdist of ``name==version`` through pip's own finder and session (its configured index, mirrors,
    find-links and certificates), without building its metadata; its hash checked when the index gives one."""
    import hashlib

    try:
        from pip._internal.commands import create_command
    except ImportError as e:  # pip's internals: present in every pip this was written against (23 ... 25)
        raise BuildError(f"this pip has no finder to reuse ({e}): download {name}-{version}.tar.gz into the kit "
                         "by hand") from None
    cmd = create_command("download")
    options, _ = cmd.parse_args([])
    with cmd.main_context():
        session = cmd.get_default_session(options)
        finder = cmd._build_package_finder(options, session)
        links = [c.link for c in finder.find_all_candidates(name)
                 if str(c.version) == version and c.link.filename.endswith(".tar.gz")]
        if not links:
            raise BuildError(f"{name}=={version}: the index pip is configured with has no source distribution")
        link = links[0]
        data = session.get(link.url_without_fragment, timeout=300).content
    if not kit.in_kit(link.filename) or "/" in link.filename:
        raise BuildError(f"the index named the sdist {link.filename!r}: not a plain file name")
    if link.hash_name == "sha256" and hashlib.sha256(data).hexdigest() != link.hash:
        raise BuildError(f"{link.filename}: sha256 differs from the index's")
    out = dest / link.filename
    out.write_bytes(data)
    return out


def te_core(args: argparse.Namespace, stage: Path, work: Path) -> str | None:
    """TE's core wheel for the node's CUDA, pruned to --arch and repacked into the kit; why it is missing, or None."""
    spec = f"transformer_engine_cu{args.cuda}=={args.te}"
    missing = download_group(args, [spec], work)
    if args.dry_run:
        print(f"{sys.executable} {HERE / 'wheelzip.py'} prune WORK/transformer_engine_cu{args.cuda}-{args.te}-*.whl "
              f"{' '.join(args.arch)} -> DIR/")
        return None
    if missing:
        extra = f"; {TE_ON_ARM}" if args.platform == "aarch64" else ""
        return f"{spec} has no {args.platform} wheel for Python {args.python}{extra}"
    wheel = next(work.glob(f"transformer_engine_cu{args.cuda}-*.whl"))
    stats = wheelzip.prune_wheel(wheel, stage, {kit.parse_arch(a) for a in args.arch})
    say(f"{wheel.name}: {stats['containers']} fatbin containers, kept {stats['kept'] / 1e6:.1f} MB of GPU code "
        f"for {', '.join(args.arch)}, zeroed {stats['zeroed'] / 1e6:.1f} MB; {wheel.stat().st_size / 1e6:.0f} MB -> "
        f"{(stage / wheel.name).stat().st_size / 1e6:.1f} MB")
    return None


def te_torch(args: argparse.Namespace, stage: Path) -> None:
    """TE's torch extension: --te-torch-wheel (checked: this TE, this Python, this platform) or --build-te."""
    if args.te_torch_wheel:
        src = Path(args.te_torch_wheel)
        if args.dry_run:
            print(f"cp {src} DIR/")
        else:
            shutil.copyfile(src, stage / src.name)
    elif args.build_te:
        python, cuda_home = find_python(args.python), find_cuda_home(dict(os.environ))
        if python is None:
            raise BuildError(f"--build-te: no Python {args.python} that runs (tried $PYTHON_BIN, python{args.python} on "
                             f"PATH, pyenv's {args.python}.*, /usr/bin, /usr/local/bin): install it or set PYTHON_BIN")
        if cuda_home is None:
            raise BuildError("--build-te: no CUDA toolkit (nvcc with include/cuda_runtime.h beside it): set CUDA_HOME, "
                             "or put its nvcc on PATH")
        cmd = ["bash", str(HERE / "build_te_torch.sh"), str(stage), python, args.torch, str(cuda_home)]
        if args.dry_run:
            print(" ".join(cmd))
        elif subprocess.run(cmd).returncode != 0:
            raise BuildError("build_te_torch.sh failed (see above)")


def groups_of(args: argparse.Namespace) -> list[Group]:
    return [g for g in GROUPS if (g.default or g.name in args.add) and g.name not in args.drop]


def fill(args: argparse.Namespace) -> list[tuple[Group, list[str]]]:
    """Each chosen group with its specs, versions filled in (with --te none: nothing of TE)."""
    out = []
    for g in groups_of(args):
        specs = [s.format(te=args.te, torchao=args.torchao, pydantic=args.pydantic) for s in g.specs]
        if args.te == "none":
            specs = [s for s in specs if not s.startswith(NO_TE_SPECS)]
        out.append((g, specs))
    return out


def collect(args: argparse.Namespace, stage: Path, work: Path) -> dict[str, str]:
    """Every wheel and the sdist into ``stage``; returns what is missing for this platform, with why."""
    for group, _ in fill(args):
        say(f"{group.name}: {group.why}")
    missing = download_group(args, [s for _, specs in fill(args) for s in specs], stage)  # one pip call
    pydantic = sorted(stage.glob("pydantic-*.whl"))
    if pydantic:  # its exact pydantic_core and the rest it needs: the pair it was released with
        needs = requirements(pydantic[0])
        say(f"{pydantic[0].name} requires {', '.join(needs)}")
        missing.update(download_group(args, needs, stage))
    elif args.dry_run:
        print(f"# then pydantic=={args.pydantic}'s own Requires-Dist (pydantic-core==...) the same way")
    if args.te != "none":
        why = te_core(args, stage, work)
        if why:
            missing[f"transformer_engine_cu{args.cuda}=={args.te}"] = why
            for wheel in stage.glob("transformer_engine-*.whl"):  # TE's Python part is useless without its core
                wheel.unlink()
        elif args.dry_run:
            print(f"# the source of TE's torch extension through pip's own finder: transformer_engine_torch=={args.te}"
                  " (.tar.gz)")
        else:
            say(f"source of TE's torch extension: {fetch_sdist('transformer_engine_torch', args.te, stage).name}")
            te_torch(args, stage)
    return missing


def target(args: argparse.Namespace, stage: Path, missing: dict[str, str]) -> dict:
    """The manifest's target: what the kit was made for, the groups, each distribution's version, what is
    missing for this platform and why."""
    versions = {}
    for wheel in sorted(stage.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        versions[name] = version
    return {"python": args.python, "torch": args.torch, "arch": ",".join(args.arch), "platform": args.platform,
            "cuda": args.cuda, "te": None if args.te == "none" or missing.get(f"transformer_engine_cu{args.cuda}=="
                                                                          f"{args.te}") else args.te,
            "torchao": args.torchao, "groups": [g.name for g in groups_of(args)], "versions": versions,
            "missing": {k: v.splitlines()[0][:300] for k, v in missing.items()}}


def check_dest(dest: Path) -> None:
    if dest.exists() and not dest.is_dir():
        raise BuildError(f"{dest} exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / kit.MANIFEST).is_file():
        raise BuildError(f"{dest} is not empty and holds no {kit.MANIFEST}: not a kit made here; give a new folder")


def move_in(stage: Path, dest: Path) -> None:
    """Replace the kit at ``dest`` by ``stage`` whole."""
    old = dest.with_name(dest.name + ".old")
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
        dest.rename(old)
    stage.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def record(args: argparse.Namespace, manifest: dict, seconds: float, repo: Path = REPO) -> dict:
    files = {n: f["bytes"] for n, f in sorted(manifest["files"].items())}
    kit_total, tree = sum(files.values()), repo_bytes(repo)
    return {"command": command_line(args), "date": time.strftime("%Y-%m-%d"), "seconds": round(seconds),
            "target": manifest["target"], "files": files, "kit_bytes": kit_total, "repo_bytes": tree,
            "total_bytes": kit_total + tree, "budget_bytes": BUDGET_BYTES, "fits": kit_total + tree <= BUDGET_BYTES}


def command_line(args: argparse.Namespace) -> str:
    """The build as a command, with file names only (a record in the repository names no path outside it)."""
    out = ["make_kit.sh", Path(args.dir).name, "--python", args.python, "--torch", args.torch]
    out += [x for a in args.arch for x in ("--arch", a)] + ["--platform", args.platform, "--te", args.te, "--torchao",
                                                            args.torchao, "--pydantic", args.pydantic, "--cuda", args.cuda]
    out += [x for g in args.add for x in ("--with", g)] + [x for g in args.drop for x in ("--without", g)]
    if args.te_torch_wheel:
        out += ["--te-torch-wheel", Path(args.te_torch_wheel).name]
    return " ".join(out + (["--build-te"] if args.build_te else []))


def build(args: argparse.Namespace) -> int:
    dest = Path(args.dir).resolve()
    check_dest(dest)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".make_kit-", dir=dest.parent if dest.parent.is_dir() else None) as tmp:
        stage, work = Path(tmp) / "kit", Path(tmp) / "work"
        stage.mkdir()
        work.mkdir()
        missing = collect(args, stage, work)
        if args.dry_run:
            print(f"{sys.executable} {HERE / 'kit.py'} manifest DIR  # target: {args.platform}, "
                  f"Python {args.python}, torch {args.torch}, {','.join(args.arch)}")
            return 0
        required = [k for k in missing if not k.startswith("transformer_engine")]
        if required:
            raise BuildError("no wheel for " + "; ".join(f"{k} ({args.platform}, Python {args.python}): "
                                                         f"{missing[k].splitlines()[0]}" for k in required))
        if (dest / "built").is_dir():  # TE extensions compiled on a node and taken back: install.py picks by record
            shutil.copytree(dest / "built", stage / "built", dirs_exist_ok=True)
        manifest = kit.write_manifest(stage, target(args, stage, missing))
        move_in(stage, dest)
    say(f"kit for {args.platform}, Python {args.python}, torch {args.torch}, {', '.join(args.arch)} in {dest}:\n"
        + size_table(manifest, missing))
    if args.record:
        rec = record(args, manifest, time.monotonic() - t0)
        Path(args.record).write_text(json.dumps(rec, indent=1, sort_keys=True) + "\n")
        say(f"record {args.record}: kit {rec['kit_bytes'] / 2**20:.1f} MiB + working tree "
            f"{rec['repo_bytes'] / 2**20:.1f} MiB = {rec['total_bytes'] / 2**20:.1f} MiB of {BUDGET_BYTES / 2**20:.0f}")
        if not rec["fits"]:
            raise BuildError(f"the kit and the working tree take {rec['total_bytes'] / 2**20:.1f} MiB, more than "
                             f"{BUDGET_BYTES / 2**20:.0f}: leave a group out (--without) or prune to fewer --arch")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return build(args)
    except (BuildError, kit.KitError, OSError) as e:
        print(f"make_kit.sh: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
