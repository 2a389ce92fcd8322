"""Pieces the container tests share: the builders' environment, the images they build once per session, a
Docker-API engine for the docker path, and what the nodes' Enroot holds.

The images live in a containers storage under the container cache (LLAMA_FP8_CONTAINER_CACHE, default
~/.cache/llama-fp8/container/storage), kept across sessions: the stand-in base (keyed by everything it is made
of) and the layers of 0.transformer-engine.dockerfile that do not depend on the code are built once. buildah and
podman run RUN steps with --isolation chroot (BUILDAH_ISOLATION): crun fails on these machines' hybrid cgroups.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_helpers import REPO, local_cluster

container_kit = local_cluster.container_kit
BUILD_IMAGE = REPO / "scripts" / "build_image.sh"
HERE = Path(__file__).resolve().parent / "container"
SMALL_BASE = "localhost/llama-fp8-tests-busybox:1"
BUILD_TIMEOUT = 2400  # a cold build: debootstrap, torch into the stand-in, the package install from the index


@dataclass
class ImageBuild:
    sqsh: Path
    log: str


def storage_conf(cache: Path) -> Path:
    """A containers storage for buildah and podman under the cache (overlay driver), kept across sessions."""
    conf = cache / "storage.conf"
    text = (f'[storage]\ndriver = "overlay"\ngraphroot = "{cache / "storage"}"\n'
            f'runroot = "{Path(tempfile.gettempdir()) / "llama-fp8-containers-run"}"\n')
    if not conf.is_file() or conf.read_text() != text:
        cache.mkdir(parents=True, exist_ok=True)
        conf.write_text(text)
    return conf


def builder_env(cluster) -> dict[str, str]:
    """The submitting host's environment for builds and imports: its Enroot is the cluster's "head" one."""
    env = cluster.env()
    for key in [k for k in env if k.startswith(("SLURM_", "ENROOT_")) or k == "SLURMD_NODENAME"]:
        env.pop(key)
    # TMPDIR (the buildah path's image archive) beside the head's Enroot temp folder: in RAM when the cluster
    # could put its Enroot state there (local_pyxis.state_base).
    env.update(CONTAINERS_STORAGE_CONF=str(storage_conf(container_kit.cache_dir())), BUILDAH_ISOLATION="chroot",
               PYTHON=sys.executable, TMPDIR=str(Path(cluster.root) / "nodes" / "head" / "enroot" / "tmp"))
    env.pop("DOCKER_HOST", None)
    return env


def run_logged(cmd: list[str], env: dict[str, str], log: Path, timeout: float = BUILD_TIMEOUT,
               cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run with stdout+stderr into `log` (kept for the failure message); the text comes back as .stdout."""
    with log.open("w") as out:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                              check=False)
    return subprocess.CompletedProcess(cmd, proc.returncode, log.read_text(), "")


def _ok(proc: subprocess.CompletedProcess[str], what: str) -> str:
    assert proc.returncode == 0, f"{what} failed (rc {proc.returncode}):\n{proc.stdout[-6000:]}"
    return proc.stdout


def build_standin(env: dict[str, str]) -> str:
    log = container_kit.cache_dir() / "standin-build.log"
    out = _ok(run_logged([str(REPO / "scripts/container/standin/build.sh")], dict(env, BUILDER="buildah"), log),
              "scripts/container/standin/build.sh")
    return out.strip().splitlines()[-1]


def build_project_image(env: dict[str, str], standin: str, out: Path) -> ImageBuild:
    log = out.parent / "build_image.log"
    proc = run_logged([str(BUILD_IMAGE), "--build-arg", f"STANDIN_BASE={standin}"],
                      dict(env, BUILDER="buildah", OUT=str(out)), log)
    return ImageBuild(out, _ok(proc, "scripts/build_image.sh"))


def build_small_base(env: dict[str, str]) -> str:
    """busybox (a static binary) as /bin/*: a shell and coreutils in ~2 MB."""
    if subprocess.run(["buildah", "inspect", "--type", "image", SMALL_BASE], env=env, capture_output=True,
                      check=False).returncode == 0:
        return SMALL_BASE
    busybox = shutil.which("busybox")
    assert busybox, "busybox-static is not installed (container_kit.APT_PACKAGES installs it)"
    with tempfile.TemporaryDirectory() as ctx:
        shutil.copy(busybox, Path(ctx) / "busybox")
        proc = run_logged(["buildah", "bud", "--format", "docker", "-f", str(HERE / "busybox.dockerfile"), "-t",
                           SMALL_BASE, ctx], env, Path(ctx) / "build.log", timeout=300)
        _ok(proc, "the busybox base")
    return SMALL_BASE


class DockerApi:
    """podman's Docker-compatible API on a private socket: what the docker CLI talks to here (no Docker daemon)."""

    def __init__(self, env: dict[str, str], folder: Path):
        self.socket = folder / "docker.sock"
        self.log = folder / "podman-service.log"
        self.proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{self.socket}"], env=env,
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.env = dict(env, DOCKER_HOST=f"unix://{self.socket}", DOCKER_BUILDKIT="0")
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "info"], env=self.env, capture_output=True, check=False).returncode != 0:
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                f"podman system service did not answer: {self.log.read_text()[-2000:]}"
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def sqsh_file(sqsh: Path, path: str) -> str:
    """A file's text inside an Enroot image (a squashfs)."""
    proc = subprocess.run(["unsquashfs", "-cat", str(sqsh), path], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{path} not in {sqsh}: {proc.stderr}"
    return proc.stdout


def node_containers(cluster, node: str) -> list[str]:
    """The Enroot containers on one node of the local cluster (Pyxis's are pyxis_<name>)."""
    return local_cluster.local_pyxis.containers(Path(cluster.root), node)


def podman_containers(env: dict[str, str]) -> list[str]:
    out = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], env=env, capture_output=True, text=True,
                         check=True).stdout
    return out.split()


def buildah_containers(env: dict[str, str]) -> list[str]:
    """The working containers in the builders' storage (buildah's and podman's), as "ID IMAGE-ID NAME" lines."""
    out = subprocess.run(["buildah", "containers", "--all", "--notruncate", "--format",
                          "{{.ContainerID}} {{.ImageID}} {{.ContainerName}}"], env=env, capture_output=True, text=True,
                         check=True).stdout
    return sorted(out.splitlines())


def remove_working_containers(env: dict[str, str]) -> list[str]:
    """Remove buildah's working containers (named IMAGE-working-container): a build that failed before
    build_image.sh asked for --force-rm left one per failure, each holding the image under it. Called when no build
    runs (the builds are all in the cluster's group, one after another). The names removed."""
    names = [line.split()[-1] for line in buildah_containers(env)]
    left = [name for name in names if name.endswith("-working-container")]
    for name in left:
        subprocess.run(["buildah", "rm", name], env=env, capture_output=True, check=False)
    return left


def prune_storage(env: dict[str, str], logs: list[str], standin: str) -> None:
    """Bound the kept storage to this session's images: remove the working containers left by failed builds,
    then untagged images that no build of this session used or made (the builds' "--> ID" and "--> Using cache ID"
    lines: kept, they are the layer cache of the next session) and stand-ins of other recipes."""
    remove_working_containers(env)
    used = {m for log in logs for m in re.findall(r"^--> (?:Using cache )?([0-9a-f]{11,64})$", log, re.M)}
    out = subprocess.run(["buildah", "images", "--filter", "dangling=true", "--format", "{{.ID}}"], env=env,
                         capture_output=True, text=True, check=False).stdout.split()
    stale = [i for i in out if not any(u.startswith(i) or i.startswith(u) for u in used)]
    tags = subprocess.run(["buildah", "images", "--format", "{{.Name}}:{{.Tag}}"], env=env, capture_output=True,
                          text=True, check=False).stdout.split()
    stale += [t for t in tags if t.startswith("localhost/llama-fp8-standin:") and t != standin]
    for image in stale:
        subprocess.run(["buildah", "rmi", image], env=env, capture_output=True, check=False)
