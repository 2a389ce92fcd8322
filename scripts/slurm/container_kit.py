#!/usr/bin/env python3
"""NVIDIA Enroot and Pyxis for the local Slurm cluster, built from the container kit.

    python3 scripts/slurm/container_kit.py build    # verify the kit, build Enroot and Pyxis (or reuse the cache)
    python3 scripts/slurm/local_cluster.py up --dir /tmp/slurm --nodes 2 --container

Neither tool is packaged by Debian or PyPI, so their pinned upstream sources come in the container kit: a folder
with enroot-<version>.tar.gz (its git submodules filled), pyxis-<version>.tar.gz, SHA256SUMS and a README. It is
found at ../shared/container next to the repository, or where LLAMA_FP8_CONTAINER_KIT points; without it the
container tests are skipped, naming the place looked at.

Builds are cached by version under LLAMA_FP8_CONTAINER_CACHE (default ~/.cache/llama-fp8/container): Enroot
compiles its install path into itself (its sysconf path), so it is built in place there; Pyxis is tied to the
exact Slurm release it was compiled against, which is part of its cache key. A build that did not finish leaves
no stamp and is redone. Standard library only.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KIT_ENV = "LLAMA_FP8_CONTAINER_KIT"
CACHE_ENV = "LLAMA_FP8_CONTAINER_CACHE"
# Building Enroot and Pyxis (libslurm-dev must be the installed Slurm's release), running Enroot (its
# `checkcmd` lists), building the images (buildah and podman, debootstrap for the stand-in base, runc: crun
# fails on hybrid cgroups; busybox: the small image of the build routes' tests) and the local registry.
APT_PACKAGES = [
    "build-essential", "squashfs-tools", "squashfuse", "fuse-overlayfs", "makeself", "musl-tools", "libmd-dev",
    "gawk", "parallel", "pigz", "zstd", "jq", "curl", "file", "gettext-base", "libcap-dev", "libslurm-dev",
    "buildah", "podman", "docker-registry", "runc", "debootstrap", "busybox-static", "slurmd",
]
REQUIRED_BINARIES = ["make", "cc", "mksquashfs", "unsquashfs", "squashfuse", "fuse-overlayfs", "musl-gcc",
                     "parallel", "pigz", "zstd", "jq", "curl", "buildah", "podman", "docker-registry", "debootstrap",
                     "runc", "busybox", "slurmd"]
# The docker CLI of the docker route's test (it talks to podman's Docker-compatible API: no daemon is started),
# installed only where there is no `docker` at all (Debian packages it with the daemon, ~150 MB).
DOCKER_CLI = ["docker.io"]
TARBALL = re.compile(r"^(enroot|pyxis)-(\d+(?:\.\d+)*)\.tar\.gz$")


class KitMissing(RuntimeError):
    """The container kit is not there: the container tests are skipped with this message."""


class KitError(RuntimeError):
    """The kit is there but unusable (checksum, build failure, Slurm mismatch)."""


@dataclass(frozen=True)
class Kit:
    root: Path
    enroot_version: str
    pyxis_version: str

    def tarball(self, tool: str) -> Path:
        return self.root / f"{tool}-{getattr(self, tool + '_version')}.tar.gz"


@dataclass(frozen=True)
class Tools:
    """What the local cluster needs: Enroot's install prefix, the Pyxis plugin and the cache folder."""

    enroot_prefix: Path
    pyxis_so: Path
    cache: Path

    @property
    def enroot(self) -> Path:
        return self.enroot_prefix / "bin" / "enroot"


def kit_dir() -> Path:
    """LLAMA_FP8_CONTAINER_KIT, else ../shared/container next to the repository."""
    return Path(os.environ.get(KIT_ENV) or REPO.parent / "shared" / "container")


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama-fp8" / "container"
    return Path(os.environ.get(CACHE_ENV) or default)


def find_kit(root: Path | None = None) -> Kit:
    """The kit's versions, after checking every tarball against SHA256SUMS (KitMissing, KitError)."""
    root = Path(root or kit_dir())
    sums = root / "SHA256SUMS"
    if not sums.is_file():
        raise KitMissing(f"no container kit at {root} (no SHA256SUMS there; set {KIT_ENV} to the kit folder)")
    versions: dict[str, str] = {}
    for line in sums.read_text().splitlines()[:20]:
        digest, _, name = line.strip().partition("  ")
        match = TARBALL.match(name)
        if not match:
            continue
        if match.group(1) in versions:
            raise KitError(f"{sums} lists two {match.group(1)} tarballs: keep one")
        path = root / name
        if not path.is_file():
            raise KitMissing(f"the container kit at {root} lacks {name} (listed in SHA256SUMS)")
        actual = sha256(path)
        if actual != digest.lower():
            raise KitError(f"{path}: sha256 {actual} but SHA256SUMS says {digest}: the kit is damaged")
        versions[match.group(1)] = match.group(2)
    missing = {"enroot", "pyxis"} - set(versions)
    if missing:
        raise KitMissing(f"the container kit at {root} has no {' or '.join(sorted(missing))} tarball in SHA256SUMS")
    return Kit(root, versions["enroot"], versions["pyxis"])


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def apt_install(packages: list[str], binaries: list[str], install: bool = True) -> None:
    """apt-get install `packages` when one of `binaries` is missing (KitError when that is impossible)."""
    missing = [b for b in binaries if shutil.which(b) is None]
    if not missing:
        return
    if os.geteuid() != 0 or not install or shutil.which("apt-get") is None:
        raise KitError(f"missing {', '.join(missing)}; install the Debian packages {' '.join(packages)} (as root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KitError(f"`{' '.join(cmd)}` failed (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")


def slurm_version() -> str:
    """The installed Slurm release (slurmd -V: "slurm-wlm 22.05.8"); libslurm-dev must be the same."""
    out = subprocess.run(["slurmd", "-V"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"(\d+\.\d+\.\d+)", out)
    if not match:
        raise KitError(f"cannot read the Slurm version from `slurmd -V`: {out!r}")
    header = Path("/usr/include/slurm/slurm_version.h")
    text = header.read_text() if header.is_file() else ""
    number = re.search(r"SLURM_VERSION_NUMBER\s+0x([0-9a-fA-F]{6})", text)  # 0x160508: 22.05.8
    dev = ".".join(str(int(number.group(1)[i:i + 2], 16)) for i in (0, 2, 4)) if number else None
    wanted = ".".join(str(int(part)) for part in match.group(1).split("."))
    if dev != wanted:
        raise KitError(f"Slurm {match.group(1)} is installed but the Slurm headers ({header}) are "
                       f"{dev or 'missing'}: install the libslurm-dev of the same release")
    return match.group(1)


@contextmanager
def _locked(cache: Path):
    """One build at a time per cache folder (two test sessions may start together)."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(cmd: list[str], cwd: Path, log: Path) -> None:
    with log.open("a") as out:
        proc = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise KitError(f"`{' '.join(cmd)}` failed in {cwd} (rc {proc.returncode}); log: {log}\n"
                       + log.read_text()[-1500:])


def _unpack(tarball: Path, into: Path) -> Path:
    """Extract a verified tarball; returns its single top folder."""
    subprocess.run(["tar", "-xzf", str(tarball), "-C", str(into), "--no-same-owner"], check=True)
    tops = [p for p in into.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise KitError(f"{tarball}: expected one top folder, found {[p.name for p in tops]}")
    return tops[0]


def build_enroot(kit: Kit, cache: Path) -> Path:
    """Enroot built and installed at cache/enroot-<version> (its compiled-in prefix); reused when stamped."""
    prefix = cache / f"enroot-{kit.enroot_version}"
    stamp = prefix / ".llama-fp8-built"
    digest = sha256(kit.tarball("enroot"))
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return prefix
    shutil.rmtree(prefix, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="enroot-build-", dir=cache) as tmp:
        src = _unpack(kit.tarball("enroot"), Path(tmp))
        log = Path(tmp) / "build.log"
        # FORCE_GLIBC=1 (no musl) fails on glibc 2.36 (undefined strlcpy): the default musl build is used.
        _run(["make", f"-j{os.cpu_count() or 1}", f"prefix={prefix}"], src, log)
        _run(["make", "install", f"prefix={prefix}"], src, log)
    stamp.write_text(digest + "\n")
    return prefix


def build_pyxis(kit: Kit, cache: Path) -> Path:
    """spank_pyxis.so compiled against the installed Slurm, cached per Pyxis and Slurm release."""
    out = cache / f"pyxis-{kit.pyxis_version}-slurm-{slurm_version()}"
    plugin, stamp = out / "spank_pyxis.so", out / ".llama-fp8-built"
    digest = sha256(kit.tarball("pyxis"))
    if plugin.is_file() and stamp.is_file() and stamp.read_text().strip() == digest:
        return plugin
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pyxis-build-", dir=cache) as tmp:
        src = _unpack(kit.tarball("pyxis"), Path(tmp))
        _run(["make", f"-j{os.cpu_count() or 1}"], src, Path(tmp) / "build.log")
        shutil.copy(src / "spank_pyxis.so", plugin)
    stamp.write_text(digest + "\n")
    return plugin


def prepare(install: bool = True, kit_root: Path | None = None) -> Tools:
    """Everything the container cluster needs from the kit: packages, then Enroot and Pyxis (cached)."""
    kit = find_kit(kit_root)
    apt_install(APT_PACKAGES, REQUIRED_BINARIES, install)
    apt_install(DOCKER_CLI, ["docker"], install)
    cache = cache_dir()
    with _locked(cache):
        prefix = build_enroot(kit, cache)
        plugin = build_pyxis(kit, cache)
    return Tools(prefix, plugin, cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["build", "where"], help="build: verify + build; where: print the paths")
    parser.add_argument("--no-install", action="store_true", help="do not apt-get install missing packages")
    args = parser.parse_args(argv)
    try:
        if args.action == "where":
            kit = find_kit()
            print(f"kit {kit.root} (enroot {kit.enroot_version}, pyxis {kit.pyxis_version}); cache {cache_dir()}")
            return 0
        tools = prepare(install=not args.no_install)
    except (KitMissing, KitError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"enroot {tools.enroot}\npyxis {tools.pyxis_so}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
