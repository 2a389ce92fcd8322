"""The image, built for real: 0.transformer-engine.dockerfile on the stand-in for the NGC base (NGC's cannot be
pulled here), and scripts/build_image.sh along every path to Enroot: docker (dockerd://, against podman's
Docker-compatible API: there is no Docker daemon here), podman (podman://), buildah with an image archive and
buildah with a registry (the local one on 127.0.0.1), then that registry image run by Pyxis on both nodes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
from container_helpers import (
    BUILD_IMAGE,
    DockerApi,
    buildah_containers,
    node_containers,
    podman_containers,
    remove_working_containers,
    run_logged,
    sqsh_file,
)
from slurm_helpers import REPO

pytestmark = pytest.mark.container


def test_the_dockerfile_builds_on_the_stand_in_with_every_step(project_image, build_env):
    """Every step runs as written: the stand-in named and checked, the EFA step's "already in the base image"
    path, the packages under the constraint file, the version proof, the presets, check-image's record; the
    builder kept the Dockerfile's SHELL (bash with pipefail) and the image holds what the runs read. (A step
    taken from the builder's cache prints nothing in this session's log: the image holds the evidence.)"""
    import torch

    sqsh = project_image.sqsh
    efa = sqsh_file(sqsh, "opt/llama-fp8/efa.log")
    assert re.search(r"^base: localhost/llama-fp8-standin:\w+, the tests' stand-in for NGC 26\.09-py3: torch ", efa,
                     re.M), efa
    assert "EFA: libfabric and the OFI NCCL plugin (/opt/amazon/aws-ofi-nccl/lib/libnccl-net-ofi.so) are already " \
           "in the base image: not installing" in efa
    assert "NCCL OFI plugin: /opt/amazon/aws-ofi-nccl/lib/libnccl-net-ofi.so" in efa
    assert not re.search(r"^error: torch/TE changed", project_image.log, re.M)
    assert sqsh_file(sqsh, "opt/llama-fp8/base-versions").split()[0] == torch.__version__
    record = json.loads(sqsh_file(sqsh, "opt/llama-fp8/image.json"))
    assert record["base"] == "stand-in" and record["ngc_tag"] == "26.09-py3" and record["torch"] == torch.__version__
    assert record["NCCL_NET_PLUGIN_FILE"] == "/opt/amazon/aws-ofi-nccl/lib/libnccl-net-ofi.so"
    constraint = sqsh_file(sqsh, "etc/pip/constraint.txt")
    assert f"torch=={torch.__version__}" in constraint.split()
    listing = subprocess.run(["unsquashfs", "-l", "-d", "", str(sqsh), "usr/local/lib"], capture_output=True,
                             text=True, check=True).stdout
    for dist in ("transformers-", "datasets-", "torchao-", "submitit-", "llama_fp8-"):
        assert re.search(rf"/{dist}[\d.]+\.dist-info/METADATA$", listing, re.M), f"{dist} not installed"
    assert re.search(r"/llama_fp8/configs/llama3\.1-8b\.yaml$", listing, re.M)
    environment = sqsh_file(sqsh, "etc/environment").splitlines()
    assert "NCCL_NET_PLUGIN=/opt/llama-fp8/nccl/libnccl-net-ofi.so" in environment
    assert 'cd "/workspace/llama-fp8"' in sqsh_file(sqsh, "etc/rc")
    digest = hashlib.sha256(sqsh.read_bytes()).hexdigest()
    assert Path(f"{sqsh}.sha256").read_text().split() == [digest, sqsh.name]
    config = json.loads(subprocess.run(["buildah", "inspect", "--type", "image", "llama-fp8:latest"], env=build_env,
                                       capture_output=True, text=True, check=True).stdout)
    assert config["Docker"]["config"]["Shell"] == ["/bin/bash", "-o", "pipefail", "-c"]


def test_standin_base_naming_another_image_stops_the_build(standin_base, build_env, tmp_path):
    """STANDIN_BASE is for the stand-in only: an image without its marker (here the stand-in less the marker,
    so that bash and Python are there) stops the build at the first step that runs, naming the argument. The
    failed build leaves no container behind: buildah keeps a failed step's working container unless told
    --force-rm, and each one kept the image under it (1.3 GB of the stand-in's layers here, one more a run)."""
    other = "localhost/llama-fp8-tests-not-standin:1"
    (tmp_path / "Dockerfile").write_text(f"FROM {standin_base}\nRUN rm /etc/llama-fp8/standin-base\n")
    subprocess.run(["buildah", "bud", "--format", "docker", "-t", other, str(tmp_path)], env=build_env,
                   capture_output=True, check=True)
    containers = buildah_containers(build_env)
    proc = run_logged([str(BUILD_IMAGE), "--build-arg", f"STANDIN_BASE={other}"],
                      dict(build_env, BUILDER="buildah", OUT=str(tmp_path / "x.sqsh")), tmp_path / "log", timeout=600)
    assert proc.returncode != 0
    assert f"error: STANDIN_BASE={other} is not the tests' stand-in for the NGC base" in proc.stdout
    assert not (tmp_path / "x.sqsh").exists()
    assert buildah_containers(build_env) == containers
    subprocess.run(["buildah", "rmi", other], env=build_env, capture_output=True, check=False)


def test_working_containers_left_by_earlier_builds_are_removed(small_base, build_env):
    """What the session's prune does first: a working container that a failed build left (here one made by
    `buildah from`) is removed, so that the image under it can go too."""
    name = "llama-fp8-tests-left-working-container"
    subprocess.run(["buildah", "from", "--name", name, small_base], env=build_env, capture_output=True, check=True)
    assert name in [line.split()[-1] for line in buildah_containers(build_env)]
    assert name in remove_working_containers(build_env)
    assert not [line for line in buildah_containers(build_env) if "-working-container" in line]


ROUTES = {  # name: (builder, what the log names as the import)
    "docker": ("docker", "dockerd://llama-fp8-route:docker"),
    "podman": ("podman", "podman://llama-fp8-route:podman"),
    "buildah-archive": ("buildah", "docker://127.0.0.1:{port}#llama-fp8-route:buildah-archive"),
    "buildah-registry": ("buildah", "docker://{registry}#llama-fp8-route:buildah-registry"),
}


@pytest.fixture(scope="module")
def routes(pyxis, build_env, small_base, tmp_path_factory):
    """build_image.sh once per path to Enroot (route.dockerfile on the busybox base); what each left behind."""
    folder = tmp_path_factory.mktemp("routes")
    results = {}
    docker = DockerApi(build_env, folder)
    try:
        for name, (builder, _) in ROUTES.items():
            tmp = folder / f"{name}.tmp"
            tmp.mkdir()
            env = dict(docker.env if builder == "docker" else build_env, BUILDER=builder, TMPDIR=str(tmp),
                       DOCKERFILE="tests/cluster/container/route.dockerfile", TAG=f"llama-fp8-route:{name}",
                       OUT=str(folder / f"{name}.sqsh"))
            if name == "buildah-registry":
                env.update(REGISTRY=f"http://{pyxis.registry}", PUSH_ARGS="--disable-compression")
            proc = run_logged([str(BUILD_IMAGE), "--build-arg", f"BASE={small_base}"], env, folder / f"{name}.log",
                              timeout=600)
            results[name] = (proc, folder / f"{name}.sqsh", sorted(os.listdir(tmp)))
    finally:
        docker.stop()
    return results


@pytest.mark.parametrize("route", ROUTES)
def test_build_image_reaches_enroot_along_each_path(route, routes, pyxis, build_env):
    """Each builder's image imports with its path; the Dockerfile's SHELL, ENV, WORKDIR and files arrive in the
    Enroot image; the import leaves no container, server or temporary folder behind."""
    proc, sqsh, leftovers = routes[route]
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"build: llama-fp8-route:{route} from tests/cluster/container/route.dockerfile with {ROUTES[route][0]}" \
        in proc.stdout
    uri = re.escape(ROUTES[route][1].format(registry=pyxis.registry, port="PORT")).replace("PORT", r"\d+")
    assert re.search(rf"^import: {uri} -> {re.escape(str(sqsh))}$", proc.stdout, re.M), proc.stdout[-3000:]
    assert sqsh_file(sqsh, "shell").strip() == "kept"
    assert "LLAMA_FP8_ROUTE=1" in sqsh_file(sqsh, "etc/environment").splitlines()
    assert 'cd "/llama-fp8"' in sqsh_file(sqsh, "etc/rc")
    assert sqsh_file(sqsh, "llama-fp8/pyproject.toml") == (REPO / "pyproject.toml").read_text()
    assert leftovers == [], f"left in TMPDIR: {leftovers}"
    assert podman_containers(build_env) == []
    assert node_containers(pyxis, "head") == []


def test_the_archive_path_serves_the_image_on_loopback_only(routes):
    """buildah without a registry: the import went through the archive server on 127.0.0.1, which is gone."""
    proc = routes["buildah-archive"][0]
    assert re.search(r"^archive: llama-fp8-route:buildah-archive -> ", proc.stdout, re.M)
    running = [p for p in Path("/proc").glob("[0-9]*") if b"serve_image.py" in _cmdline(p)]
    assert running == [], "serve_image.py still running"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_pyxis_runs_the_registry_image_on_both_nodes(routes, pyxis, job_env, tmp_path):
    """A registry image (not a file) under real Pyxis: each node's Enroot loads it (use_enroot_load=1), the
    task runs in the image's WORKDIR with its ENV; the unnamed containers are gone afterwards."""
    assert routes["buildah-registry"][0].returncode == 0
    with urllib.request.urlopen(f"http://{pyxis.registry}/v2/llama-fp8-route/tags/list", timeout=10) as answer:
        assert "buildah-registry" in json.loads(answer.read())["tags"]
    image = f"{pyxis.registry}#llama-fp8-route:buildah-registry"
    proc = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", f"--container-image={image}", "sh", "-c",
                           'echo "$SLURMD_NODENAME $(cat /shell) $LLAMA_FP8_ROUTE $(pwd)"'], env=job_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["n1 kept 1 /llama-fp8", "n2 kept 1 /llama-fp8"]
    assert node_containers(pyxis, "n1") == [] and node_containers(pyxis, "n2") == []
