"""The arm64 image (GB200/GB300 hosts are Grace, aarch64), as plumbing: this x86 machine has no arm64 host and no
binfmt emulation, so nothing here builds an arm64 image. What is tested: the platform reaches every step
(scripts/build_image.sh gives the builder --platform and enroot --arch, through stand-ins for docker and enroot
that record their arguments; a host that can run neither stops first), the EFA step takes the installer's packages
for the image's CPU and refuses a tarball without them, the plugin finder's aarch64 layouts (fake trees), the
image's own check of its platform, and the NGC table's arm64 column."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from slurm_helpers import REPO
from test_image import LAYOUTS, finder, make

from llama_fp8.cluster import ngc
from llama_fp8.cluster.nodes import nccl

BUILD = REPO / "scripts" / "build_image.sh"
INSTALL_EFA = REPO / "scripts" / "image" / "install_efa.sh"


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def tools(tmp_path):
    """docker (a daemon that answers; build records its arguments and reads the context), enroot (import writes
    the image file and records its arguments), and a binfmt folder with an aarch64 handler."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    stub(bin_dir, "docker", f'echo "docker $*" >> {log}\n[[ $1 == build ]] && cat >/dev/null\nexit 0\n')
    stub(bin_dir, "enroot", f'echo "enroot $*" >> {log}\nwhile (($#)); do [[ $1 == -o ]] && : > "$2"; shift; done\n')
    binfmt = tmp_path / "binfmt"
    binfmt.mkdir()
    (binfmt / "qemu-aarch64").write_text("enabled\ninterpreter /usr/bin/qemu-aarch64-static\n")
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "BUILDER": "docker", "OUT": str(tmp_path / "x.sqsh"),
           "BINFMT_DIR": str(binfmt)}
    return env, log, binfmt


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the emulation check is tested from an x86_64 host")
def test_the_platform_reaches_the_build_and_the_import(tools, tmp_path):
    env, log, _ = tools
    proc = subprocess.run([str(BUILD)], env={**env, "PLATFORM": "linux/arm64"}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    [build] = [c for c in calls if c.startswith("docker build")]
    [imp] = [c for c in calls if c.startswith("enroot import")]
    assert "--platform linux/arm64" in build and imp.startswith("enroot import --arch aarch64 -o ")
    assert "build: llama-fp8:latest from 0.transformer-engine.dockerfile with docker for linux/arm64" in proc.stdout
    log.write_text("")
    proc = subprocess.run([str(BUILD)], env=env, capture_output=True, text=True, timeout=120)  # no PLATFORM: as before
    assert proc.returncode == 0 and "--platform" not in log.read_text() and "--arch" not in log.read_text()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the emulation check is tested from an x86_64 host")
def test_an_arm64_build_without_emulation_stops_before_building(tools, tmp_path):
    env, log, binfmt = tools
    (binfmt / "qemu-aarch64").unlink()
    proc = subprocess.run([str(BUILD)], env={**env, "PLATFORM": "linux/arm64"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "no aarch64 emulation" in proc.stderr and "Build on an aarch64 host" in proc.stderr
    assert not log.exists()
    proc = subprocess.run([str(BUILD), "--print-plan"], env={**env, "PLATFORM": "linux/riscv64"}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "PLATFORM=linux/riscv64: use linux/amd64 or linux/arm64" in proc.stderr


def test_the_plan_names_the_platform_in_every_step(tools):
    env, _, _ = tools
    proc = subprocess.run([str(BUILD), "--print-plan"], env={**env, "PLATFORM": "linux/arm64"}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--platform linux/arm64" in proc.stdout and "enroot import --arch aarch64" in proc.stdout


def efa_tarball(folder: Path, archs: tuple[str, ...]) -> Path:
    """An EFA installer tarball whose efa_installer.sh records that it ran, with packages for ``archs``."""
    path = folder / "efa.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        files = {"aws-efa-installer/efa_installer.sh": f"#!/bin/bash\necho installer ran \"$@\" > {folder}/ran\n"}
        files.update({f"aws-efa-installer/DEBS/UBUNTU2404/{a}/libfabric1-aws_2.6.0_{a}.deb": "" for a in archs})
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text), 0o755
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


@pytest.mark.parametrize("archs, ok", [(("x86_64", "aarch64"), True), (("x86_64",), False)])
def test_the_efa_step_takes_the_packages_of_the_images_cpu(tmp_path, archs, ok):
    tarball = efa_tarball(tmp_path, archs)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "curl", f'while (($#)); do [[ $1 == -o ]] && cp {tarball} "$2"; shift; done\n')
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "EFA_INSTALLER_VERSION": "1.50.0", "EFA_ARCH": "aarch64",
           "EFA_ROOT": str(tmp_path / "empty-root")}
    proc = subprocess.run([str(INSTALL_EFA)], env=env, capture_output=True, text=True, timeout=60)
    if ok:
        assert proc.returncode == 0, proc.stderr
        assert "packages for aarch64: DEBS/UBUNTU2404/aarch64" in proc.stdout and (tmp_path / "ran").is_file()
    else:
        assert proc.returncode == 1 and not (tmp_path / "ran").exists()
        assert "EFA installer 1.50.0 has no packages for aarch64 (no DEBS/*/aarch64 or RPMS/*/aarch64)" in proc.stderr


AARCH64 = "opt/amazon/ofi-nccl/lib/aarch64-linux-gnu"
AARCH64_LAYOUTS = {  # the installer's deb on arm64 (MULTIARCH_DIR = aarch64-linux-gnu), and the flat ones
    "installer-1.43-aarch64": ({f"{AARCH64}/libnccl-net-ofi.so": None, f"{AARCH64}/libnccl-net.so": "libnccl-net-ofi.so",
                                f"{AARCH64}/libnccl-ofi-tuner.so": "libnccl-net-ofi.so"},
                               f"{AARCH64}/libnccl-net-ofi.so", f"{AARCH64}/libnccl-ofi-tuner.so"),
    "installer>=1.44": LAYOUTS["installer>=1.44"],
    "ngc-v3": LAYOUTS["ngc-v3"],
    "rpm-lib64": ({"opt/amazon/ofi-nccl/lib64/libnccl-net-ofi.so": None},
                  "opt/amazon/ofi-nccl/lib64/libnccl-net-ofi.so", "opt/amazon/ofi-nccl/lib64/libnccl-net-ofi.so"),
}


@pytest.mark.parametrize("layout", AARCH64_LAYOUTS)
def test_the_finder_reads_the_aarch64_layouts(layout, tmp_path, monkeypatch):
    files, plugin, tuner = AARCH64_LAYOUTS[layout]
    root = make(tmp_path / "root", files)
    monkeypatch.setenv("PLUGIN_ARCH", "aarch64")
    proc = finder(str(root))
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == str(root / plugin), proc.stderr
    assert finder("--tuner", str(root)).stdout.splitlines()[-1] == str(root / tuner)
    assert nccl.find_plugin(str(root), arch="aarch64") == str(root / plugin)
    if layout.endswith("aarch64"):  # an x86_64 search does not take an aarch64 tree's plugin
        monkeypatch.setenv("PLUGIN_ARCH", "x86_64")
        assert finder(str(root)).returncode == 1 and nccl.find_plugin(str(root), arch="x86_64") is None


def test_the_image_checks_its_own_platform():
    assert ngc.platform_problem(None, "x86_64") == "" and ngc.platform_problem("arm64", "aarch64") == ""
    assert ngc.platform_problem("arm64", "x86_64") == ("the build asked for linux/arm64 but runs on x86_64: the base "
                                                       "image is not the arm64 one")
    assert "TARGETARCH ppc64le: not a platform of this image" in ngc.platform_problem("ppc64le", "ppc64le")
    text = (REPO / "0.transformer-engine.dockerfile").read_text()
    assert text.index("ARG TARGETARCH") > text.index("FROM ") and '--platform "${TARGETARCH}"' in text


def test_the_ngc_table_says_which_tags_have_an_arm64_image():
    table = ngc.table_markdown()
    header = table.splitlines()[0]
    assert header.endswith("| linux/arm64 |")
    row = next(x for x in table.splitlines() if x.startswith("| `26.06-py3`"))
    assert row.rstrip(" |").split("|")[-1].strip().startswith("yes [")  # with its source
    assert next(x for x in table.splitlines() if x.startswith("| `25.06-py3`")).endswith("| not confirmed |")
    assert "Neu-PAN_MK-mini docker/README.md" in table and "(third-party)" in table
