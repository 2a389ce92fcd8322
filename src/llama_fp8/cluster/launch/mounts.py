"""Every path a containerized run reads or writes must be a Pyxis mount; otherwise it lands in the container's
throw-away root file system (results lost when the job ends) or is simply not there (data, tokenizer).

Run on the login/head node by 1.train_llama.sbatch before its first ``srun`` (standard library only, Python
3.7+, so the host's ``python3`` runs it without the training dependencies)::

    python3 -m llama_fp8.cluster.launch.mounts --repo /fsx/llama-fp8 --workdir /fsx/llama-fp8 \\
        [--mounts "$CONTAINER_MOUNTS"] [--path AB_DIR=/fsx/ab] -- TRAIN_FLAGS...

prints the ``--container-mounts`` value to use and exits 0, or names each uncovered path and exits 1.
Without ``--mounts`` (CONTAINER_MOUNTS unset) the mounts are computed: the repository, the working directory
and, for each path outside them, the path itself (read) or its nearest existing folder (write). With
``--mounts`` (the user chose) nothing is added: an uncovered path is refused. Preflight repeats the check
inside the container on the fully resolved config (paths set in a --config YAML included).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath

# The one list of train flags that name files or folders: (flag, written by the run?). Values that are hub names (no
# "/" prefix and not an existing path) are not paths; --mlflow_tracking_uri is one only for a store on a file system
# (tracking_uri_path). tests/cluster/test_mounts.py fails on a new string flag that is neither here nor declared
# not a path.
PATH_FLAGS = (("run_dir", True), ("checkpoint_dir", True), ("tensorboard_dir", True), ("prometheus_textfile_dir", True),
              ("mlflow_tracking_uri", True), ("dataset", False), ("tokenizer", False), ("init_from_hf", False),
              ("config", False), ("resume_from_checkpoint", False), ("data_blend", False))
URI_FLAGS = ("mlflow_tracking_uri",)
# Flags whose value names several paths: --data_blend W1:PATH1,W2:PATH2 (parsed here by hand: this module runs on the
# host's python, without the package's dependencies).
MULTI_PATH = {"data_blend": lambda v: [part.partition(":")[2].strip() for part in v.split(",") if ":" in part]}
NOT_PATHS = {"synthetic", "auto", "none", ""}
# Hugging Face caches: written (downloads) when set; unset means ~/.cache inside the container.
ENV_PATHS = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE")
MOUNTS_ENV = "LLAMA_FP8_CONTAINER_MOUNTS"
"""Set by the launch scripts inside the container (the mounts in effect), read by preflight."""


@dataclass
class Mount:
    source: str
    target: str
    flags: str = ""

    @property
    def read_only(self) -> bool:
        return "ro" in self.flags.replace("+", ",").split(",")

    def spec(self) -> str:
        return ":".join([self.source, self.target] + ([self.flags] if self.flags else []))


@dataclass
class RunPath:
    what: str  # "--run_dir", "HF_HOME", "AB_DIR", ...
    path: str  # absolute, as the container sees it
    write: bool


def parse_mounts(spec: str) -> list[Mount]:
    """Pyxis ``--container-mounts`` syntax: ``SRC[:DST[:FLAGS]][,...]`` (DST defaults to SRC; pyxis args.c)."""
    mounts = []
    for item in (s for s in spec.split(",") if s.strip()):
        parts = item.strip().split(":", 2)
        source = parts[0]
        target = parts[1] if len(parts) > 1 and parts[1] else source
        mounts.append(Mount(source, target, parts[2] if len(parts) > 2 else ""))
    return mounts


def _norm(path: str) -> str:
    return os.path.normpath(path)


def under(path: str, folder: str) -> bool:
    path, folder = _norm(path), _norm(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def mount_for(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount whose target holds ``path`` (the deepest one, as the kernel resolves it), or None."""
    holding = [m for m in mounts if under(path, m.target)]
    return max(holding, key=lambda m: len(_norm(m.target))) if holding else None


def looks_local(value: str, cwd: str) -> bool:
    """A path (absolute, ./ ../ ~ or an existing relative path) rather than a hub name."""
    if value.startswith(("/", "./", "../", "~")):
        return True
    return os.path.exists(os.path.join(cwd, value))


def absolute(value: str, cwd: str) -> str:
    return _norm(os.path.join(cwd, os.path.expanduser(value)))


def tracking_uri_path(uri: str) -> str | None:
    """The folder an MLflow tracking URI writes to on a file system (relative to the working directory when not
    absolute), or None for a server or a database elsewhere: a ``file:`` store or a plain path is that folder, a
    ``sqlite:///`` database the folder that holds it (SQLite writes its journal beside it)."""
    if uri.startswith("sqlite:///"):
        return os.path.dirname(uri[len("sqlite:///"):]) or "."
    if uri.startswith("file:"):
        rest = uri[len("file:"):]
        return "/" + rest.lstrip("/") if rest.startswith("//") else rest
    if ":" in uri or uri.split("-")[0] in ("databricks", "uc"):  # http(s)://, postgresql://, an ARN, Databricks
        return None
    return uri


def train_path_values(train_args: list[str]) -> dict[str, str]:
    """The path flags given on the command line (``--flag value`` and ``--flag=value``); others ignored."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, _ in PATH_FLAGS:
        p.add_argument(f"--{flag}")
    known, _ = p.parse_known_args(train_args)
    return {k: v for k, v in vars(known).items() if v is not None}


def config_path_values(config_file: str) -> dict[str, str]:
    """Path keys of a --config YAML (flat or one level of sections), when PyYAML is importable here."""
    try:
        import yaml
    except ImportError:
        return {}
    try:
        with open(config_file) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return {}  # preflight reports an unreadable --config inside the container
    found = {}
    for flag, _ in PATH_FLAGS:
        for section in [data] + [v for v in data.values() if isinstance(v, dict)]:
            if isinstance(section, dict) and isinstance(section.get(flag), str):
                found.setdefault(flag, section[flag])
    return found


def run_paths(values: dict[str, str], cwd: str, env: dict[str, str],
              extra: dict[str, str] | None = None) -> list[RunPath]:
    """Paths the run touches: from the path flags' values, the HF cache variables and ``extra`` (NAME=PATH of
    the launch script, e.g. AB_DIR). The run dir defaults to runs/job_<id> under ``cwd``, like train does."""
    values = dict(values)
    if "run_dir" not in values:
        values["run_dir"] = os.path.join("runs", "job_" + env.get("SLURM_JOB_ID", "local"))
    out = []
    for flag, write in PATH_FLAGS:
        value = values.get(flag)
        if value is not None and flag in URI_FLAGS:
            value = tracking_uri_path(str(value))
        if value is None or str(value).lower() in NOT_PATHS or str(value).startswith("s3://"):
            continue  # an S3 prefix is reached over the network, not through a mount
        for one in MULTI_PATH[flag](str(value)) if flag in MULTI_PATH else [str(value)]:
            if write or flag == "config" or looks_local(one, cwd):
                out.append(RunPath(f"--{flag}", absolute(one, cwd), write))
    for name in ENV_PATHS:
        if env.get(name):
            out.append(RunPath(name, absolute(env[name], cwd), True))
    for name, value in (extra or {}).items():
        out.append(RunPath(name, absolute(value, cwd), True))
    return out


def problems(paths: list[RunPath], mounts: list[Mount]) -> list[str]:
    """One message per path that is not a mount, or a read-only mount for a path the run writes."""
    out = []
    for rp in paths:
        m = mount_for(rp.path, mounts)
        if m is None:
            lost = ("written there stays in the container and is lost when the job ends" if rp.write
                    else "it does not exist inside the container")
            out.append(f"{rp.what} {rp.path} is outside the container mounts: {lost}")
        elif rp.write and m.read_only:
            out.append(f"{rp.what} {rp.path} is on the read-only mount {m.spec()}")
    return out


def nearest_existing(path: str) -> str:
    p = PurePosixPath(path)
    while not os.path.exists(str(p)) and p != p.parent:
        p = p.parent
    return str(p)


def auto_mounts(paths: list[RunPath], base: list[Mount]) -> list[Mount]:
    """``base`` plus a same-path mount for each uncovered path: the path itself when it exists, else (a folder
    the run will create) its nearest existing parent. Raises ValueError for a missing input or for "/"."""
    mounts = list(base)
    for rp in paths:
        if mount_for(rp.path, mounts) is not None:
            continue
        source = rp.path if os.path.exists(rp.path) else (nearest_existing(rp.path) if rp.write else None)
        if source is None:
            raise ValueError(f"{rp.what} {rp.path}: no such file or directory on this host")
        if source == "/":
            raise ValueError(f"{rp.what} {rp.path}: no part of it exists on this host (would have to mount /)")
        mounts.append(Mount(source, source))
    return mounts


def paths_markdown() -> str:
    """docs/cluster.md's list of what is mounted, from PATH_FLAGS and ENV_PATHS (generated: the docs cannot drift)."""
    def named(write: bool) -> str:
        return ", ".join(f"`--{f}`" + (" (a `file:`, `sqlite:///` or plain-path store)" if f in URI_FLAGS else "")
                         for f, w in PATH_FLAGS if w == write)

    return (f"- written by the run: {named(True)}, and the Hugging Face caches "
            f"{', '.join(f'`{n}`' for n in ENV_PATHS)} when set;\n- read by the run (when a local path): {named(False)}.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m llama_fp8.cluster.launch.mounts", allow_abbrev=False,
                                usage="%(prog)s --repo DIR --workdir DIR [--mounts SPEC] [--path NAME=PATH]... "
                                      "-- TRAIN_FLAGS...",
                                description="Pyxis mounts for a run: computed, or checked when given.")
    p.add_argument("--repo", required=True, help="the repository (always mounted at its own path)")
    p.add_argument("--workdir", required=True, help="--container-workdir: relative train paths resolve here")
    p.add_argument("--mounts", default=None,
                   help="the user's CONTAINER_MOUNTS: checked, nothing added (default: computed)")
    p.add_argument("--path", action="append", default=[], metavar="NAME=PATH",
                   help="another path the launch script writes (e.g. AB_DIR=/fsx/ab)")
    return p


def main(argv: list[str]) -> int:
    own, train = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    try:
        args = build_parser().parse_args(own)
        extra = dict(item.split("=", 1) for item in args.path)
    except SystemExit as e:
        return int(e.code or 0)
    except ValueError:
        print("mounts: error: --path takes NAME=PATH", file=sys.stderr)
        return 2
    values = train_path_values(train)
    if "config" in values:
        for key, value in config_path_values(absolute(values["config"], args.workdir)).items():
            values.setdefault(key, value)
    paths = [RunPath("the working directory", _norm(args.workdir), False)]
    paths += run_paths(values, args.workdir, dict(os.environ), extra)
    if args.mounts is not None:
        mounts = parse_mounts(args.mounts)
        bad = problems(paths, mounts)
        if bad:
            for message in bad:
                print(f"error: {message}", file=sys.stderr)
            print(f"Add the missing paths to CONTAINER_MOUNTS={args.mounts} (SRC:DST,... e.g. /fsx:/fsx), or unset "
                  "CONTAINER_MOUNTS to have them mounted at their own paths.", file=sys.stderr)
            return 1
    else:
        try:
            mounts = auto_mounts(paths, [Mount(_norm(args.repo), _norm(args.repo))])
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(",".join(m.spec() for m in mounts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
