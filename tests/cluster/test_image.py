"""The image's EFA step and build context, without a Docker engine.

- scripts/image/nccl_net_plugin.sh finds the OFI plugin in every layout the EFA installer and NGC images use
  (fake root folders below; layouts cited in the script's header) and fails, naming every place, without one.
- scripts/image/setup_nccl_plugin.sh creates exactly what the Dockerfile's static ENV names.
- scripts/build_image.sh sends docker an explicit list of regular files holding everything the Dockerfile
  COPYs, the presets included, and no symlink (the repository's `configs` is one).
"""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
from slurm_helpers import REPO

from llama_fp8.cluster import ngc
from llama_fp8.cluster.nodes import nccl

FINDER = REPO / "scripts" / "image" / "nccl_net_plugin.sh"
SETUP = REPO / "scripts" / "image" / "setup_nccl_plugin.sh"
DOCKERFILE = REPO / "0.transformer-engine.dockerfile"
ARCH = os.uname().machine
MULTIARCH = f"opt/amazon/ofi-nccl/lib/{ARCH}-linux-gnu"


def make(root: Path, files: dict[str, str | None]) -> Path:
    """Create ``files`` under ``root``: value None = a regular file, a string = a symlink to that target."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, target in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if target is None:
            path.write_bytes(b"\x7fELF fake")
        else:
            path.symlink_to(target)
    return root


# layout name -> (files, expected plugin, expected tuner), paths relative to the root
LAYOUTS = {
    # EFA installer 1.39-1.41, aws-ofi-nccl <= 1.14: a real libnccl-net.so and a separate tuner library
    "installer<=1.41": ({f"{MULTIARCH}/libnccl-net.so": None, f"{MULTIARCH}/libnccl-ofi-tuner.so": None},
                        f"{MULTIARCH}/libnccl-net.so", f"{MULTIARCH}/libnccl-ofi-tuner.so"),
    # EFA installer 1.43 (aws-ofi-nccl 1.16): real libnccl-net-ofi.so and links to it (listing in
    # awslabs/awsome-distributed-ai PR #936)
    "installer-1.43": ({f"{MULTIARCH}/libnccl-net-ofi.so": None, f"{MULTIARCH}/libnccl-net.so": "libnccl-net-ofi.so",
                        f"{MULTIARCH}/libnccl-ofi-tuner.so": "libnccl-net-ofi.so",
                        f"{MULTIARCH}/libnccl-tuner-ofi.so": "libnccl-net-ofi.so",
                        "etc/ld.so.conf.d/100_ofinccl.conf": None},
                       f"{MULTIARCH}/libnccl-net-ofi.so", f"{MULTIARCH}/libnccl-ofi-tuner.so"),
    # EFA installer >= 1.44 (aws-ofi-nccl >= 1.17, commits 6eb0870a and 4bb2eae0): flat folder, real libraries
    "installer>=1.44": ({"opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so": None, "opt/amazon/ofi-nccl/lib/libnccl-net.so": None,
                         "opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so": None,
                         "opt/amazon/ofi-nccl/lib/libnccl-tuner-ofi.so": None, "etc/ld.so.conf.d/100_ofinccl.conf": None},
                        "opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so", "opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so"),
    # EFA installer 1.48 on an NGC base: libnccl-ofi-ngc-v1/v2/v3 (aws-ofi-nccl ee7c5a43), no libnccl-net.so
    "ngc-v1": ({"opt/amazon/aws-ofi-nccl/lib/libnccl-net-aws-ofi.so": None,
                "opt/amazon/aws-ofi-nccl/lib/libnccl-tuner-aws-ofi.so": None},
               "opt/amazon/aws-ofi-nccl/lib/libnccl-net-aws-ofi.so", "opt/amazon/aws-ofi-nccl/lib/libnccl-tuner-aws-ofi.so"),
    "ngc-v2": ({"opt/amazon/aws-ofi-nccl/lib/libnccl-net-ofi.so": None,
                "opt/amazon/aws-ofi-nccl/lib/libnccl-tuner-ofi.so": None},
               "opt/amazon/aws-ofi-nccl/lib/libnccl-net-ofi.so", "opt/amazon/aws-ofi-nccl/lib/libnccl-tuner-ofi.so"),
    "ngc-v3": ({"opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so": None, "opt/amazon/ofi-nccl/lib/libnccl-tuner-ofi.so": None},
               "opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so", "opt/amazon/ofi-nccl/lib/libnccl-tuner-ofi.so"),
    # A base image that ships its own plugin (NGC, NVIDIA-NeMo/RL#1973: /opt/amazon/aws-ofi-nccl/lib); no tuner
    # file: the net plugin itself is the tuner NCCL is pointed at
    "in-base-image": ({"opt/amazon/aws-ofi-nccl/lib/libnccl-net.so": None},
                      "opt/amazon/aws-ofi-nccl/lib/libnccl-net.so", "opt/amazon/aws-ofi-nccl/lib/libnccl-net.so"),
    # The base's old plugin and the one the installer just added: the installer's wins
    "base-and-installer": ({"opt/amazon/aws-ofi-nccl/lib/libnccl-net.so": None,
                            "opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so": None},
                           "opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so", "opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so"),
    # Source builds in AWS samples
    "source-build": ({"opt/aws-ofi-nccl/lib/libnccl-net.so": None},
                     "opt/aws-ofi-nccl/lib/libnccl-net.so", "opt/aws-ofi-nccl/lib/libnccl-net.so"),
}


def finder(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(FINDER), *args], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_finder_prints_the_plugin_of_every_layout(layout, tmp_path):
    files, plugin, tuner = LAYOUTS[layout]
    root = make(tmp_path / "root", files)
    proc = finder(str(root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(root / plugin)
    proc = finder("--tuner", str(root))
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == str(root / tuner)
    assert nccl.find_plugin(str(root)) == str(root / plugin), "the Python search (preflight) must agree"


@pytest.mark.parametrize("files", [{}, {"opt/amazon/ofi-nccl/lib/libnccl-net.so": "/nonexistent/libnccl-net-ofi.so"},
                                   {"opt/amazon/ofi-nccl/lib/libnccl-ofi-tuner.so": None}],
                         ids=["none", "dangling-link", "tuner-only"])
def test_finder_fails_naming_every_place_when_there_is_no_plugin(files, tmp_path):
    root = make(tmp_path / "root", files)
    proc = finder(str(root))
    assert proc.returncode == 1 and proc.stdout == ""
    looked = [ln.strip() for ln in proc.stderr.splitlines() if ln.startswith("  ")]
    for folder in nccl.OFI_DIRS:
        for name in nccl.NET_NAMES:
            assert str(root) + folder.format(arch=ARCH) + "/" + name in looked
    assert nccl.find_plugin(str(root)) is None


def test_finder_on_the_real_root_and_bad_usage():
    assert finder().returncode == 2 and finder("/nonexistent-root-folder").returncode == 2


def dockerfile_env() -> dict[str, str]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


@pytest.mark.parametrize("layout", LAYOUTS)
def test_setup_links_what_the_static_env_names(layout, tmp_path):
    """After setup_nccl_plugin.sh ROOT, the Dockerfile's NCCL_NET_PLUGIN / NCCL_TUNER_PLUGIN and the first
    LD_LIBRARY_PATH entry, resolved inside ROOT, are the plugin file, the tuner and the plugin's folder."""
    files, plugin, tuner = LAYOUTS[layout]
    root = make(tmp_path / "root", files)
    proc = subprocess.run([str(SETUP), str(root)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    env = dockerfile_env()

    def inside(path: str) -> Path:  # follow the image-absolute link targets within ROOT
        p = root / path.lstrip("/")
        while p.is_symlink() and os.readlink(p).startswith("/"):
            p = root / os.readlink(p).lstrip("/")
        return p

    assert inside(env["NCCL_NET_PLUGIN"]) == root / plugin
    assert inside(env["NCCL_TUNER_PLUGIN"]).resolve() == (root / tuner).resolve()
    first_lib = env["LD_LIBRARY_PATH"].split(":")[0]
    assert inside(first_lib) == (root / plugin).parent
    conf = (root / "etc/ld.so.conf.d/000_llama-fp8-ofi-nccl.conf").read_text().split()
    assert conf == ["/" + str(Path(plugin).parent), "/opt/amazon/efa/lib"]
    recorded = dict(ln.split("=", 1) for ln in (root / "opt/llama-fp8/nccl/plugin.env").read_text().split())
    assert recorded == {"NCCL_NET_PLUGIN_FILE": "/" + plugin, "NCCL_TUNER_PLUGIN_FILE": "/" + tuner}


def test_setup_fails_the_build_only_without_any_plugin(tmp_path):
    root = make(tmp_path / "root", {"opt/amazon/efa/lib/libfabric.so.1": None})
    proc = subprocess.run([str(SETUP), str(root)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "no aws-ofi-nccl net plugin" in proc.stderr
    assert not (root / "opt/llama-fp8/nccl/libnccl-net-ofi.so").exists()


def test_install_skips_when_the_base_has_libfabric_and_a_plugin(tmp_path):
    """No download when both are there (the check runs before any network access)."""
    root = make(tmp_path / "root", {"opt/amazon/efa/lib/libfabric.so.1": None,
                                    "opt/amazon/aws-ofi-nccl/lib/libnccl-net-ofi.so": None})
    proc = subprocess.run([str(REPO / "scripts/image/install_efa.sh")], capture_output=True, text=True, check=False,
                          env=dict(os.environ, EFA_ROOT=str(root), EFA_INSTALLER_VERSION="1.49.0", PATH="/usr/bin:/bin"))
    assert proc.returncode == 0, proc.stderr
    assert f"({root}/opt/amazon/aws-ofi-nccl/lib/libnccl-net-ofi.so) are already in the base image" in proc.stdout


def test_dockerfile_env_never_points_at_one_hard_coded_install_folder():
    """The old Dockerfile put /opt/amazon/ofi-nccl/lib on LD_LIBRARY_PATH and checked only libnccl-net*.so
    there: NGC v1/v2 plugins (/opt/amazon/aws-ofi-nccl/lib) and <= 1.43 layouts were missed."""
    env = dockerfile_env()
    assert env["NCCL_NET_PLUGIN"].startswith("/") and env["NCCL_NET_PLUGIN"].endswith(".so")
    assert "/opt/amazon/ofi-nccl/lib" not in env["LD_LIBRARY_PATH"].split(":")


# ---- versions ------------------------------------------------------------------------------------------

def dockerfile_arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)", DOCKERFILE.read_text(), flags=re.M).group(1)


def test_dockerfile_defaults_are_the_tables_default_pair():
    row = ngc.release(dockerfile_arg("NGC_TAG"))
    assert row is not None and row.tag == ngc.DEFAULT_TAG
    assert dockerfile_arg("EFA_INSTALLER_VERSION") == row.efa_installer
    assert ngc.installer(row.efa_installer) is not None


# ---- build context -------------------------------------------------------------------------------------

def context_files() -> list[str]:
    proc = subprocess.run([str(REPO / "scripts/build_image.sh"), "--print-context"], capture_output=True,
                          text=True, check=True)
    return proc.stdout.split()


def copy_sources() -> list[str]:
    sources = []
    for line in DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        if line.startswith("COPY "):
            sources += [t for t in line.split()[1:-1] if not t.startswith("--")]
    return sources


def test_copy_sources_are_real_and_in_the_context():
    files = context_files()
    assert "configs" not in [s.rstrip("/") for s in copy_sources()], "COPY of the configs symlink"
    for src in copy_sources():
        path = REPO / src
        assert path.exists() and not path.is_symlink(), f"COPY {src}: must be a real file or folder"
        src = src.rstrip("/")
        assert src in files or any(f.startswith(src + "/") for f in files), f"COPY {src}: not in the build context"


def test_context_has_the_presets_and_nothing_heavy():
    files = context_files()
    presets = sorted(p.name for p in (REPO / "src/llama_fp8/configs").resolve().glob("*.yaml"))
    assert presets and all(f"src/llama_fp8/configs/{p}" in files for p in presets)
    assert not [f for f in files if f.startswith((".venv", "runs/", "logs/", ".git/")) or f.endswith((".sqsh", ".pyc"))
                or "__pycache__" in f]
    assert "0.transformer-engine.dockerfile" in files


def test_context_tar_holds_regular_files_only(tmp_path):
    tar = tmp_path / "ctx.tar"
    subprocess.run([str(REPO / "scripts/build_image.sh"), "--context-tar", str(tar)], check=True)
    with tarfile.open(tar) as t:
        members = t.getmembers()
    assert [m.name for m in members] == context_files()
    assert all(m.isfile() for m in members), [m.name for m in members if not m.isfile()]


@pytest.mark.slow
def test_a_wheel_built_from_the_context_ships_the_presets(tmp_path):
    """What `pip install .` does in the image: the installed package has every preset (package data)."""
    tar = tmp_path / "ctx.tar"
    subprocess.run([str(REPO / "scripts/build_image.sh"), "--context-tar", str(tar)], check=True)
    ctx = tmp_path / "ctx"
    with tarfile.open(tar) as t:
        t.extractall(ctx, filter="data")
    import sys

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(ctx)], check=True, capture_output=True)
    import zipfile

    wheel = next((tmp_path / "wheel").glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    presets = sorted(p.name for p in (REPO / "src/llama_fp8/configs").resolve().glob("*.yaml"))
    assert all(f"llama_fp8/configs/{p}" in names for p in presets), names
