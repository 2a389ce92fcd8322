"""The offline kit's builder for real, on stub wheels: make_kit.sh downloads through pip (here from a local
find-links folder, as from any configured index), takes TE's sdist through pip's own finder, prunes TE's core
library inside its wheel (zipfile, RECORD updated), pins pydantic_core as pydantic's metadata names it, and moves
the kit into place whole; for arm64 it picks the aarch64 wheels and says what to do where one does not exist.
The record of a real build (docs/kit-build.json) is checked against the 60 MiB a command carries."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import build_kit
import kit
import kit_fakes as fakes
import pytest
import te_wheel

REPO = Path(__file__).resolve().parents[3]
MAKE_KIT = REPO / "scripts" / "offline" / "make_kit.sh"
TE, CORE = "2.20.2", "2.50.5"
LIB = "transformer_engine/wheel_lib/libtransformer_engine.so"
X86, ARM = "manylinux_2_28_x86_64", "manylinux_2_28_aarch64"


def stub_index(root: Path, *, arm_core: bool = True, arm_ml_dtypes: bool = True) -> Path:
    """A find-links folder with every wheel the builder asks for, for x86_64 and (unless told) aarch64, a newer
    pydantic_core than pydantic pins (which must not be taken), and TE's torch extension as source."""
    idx = root / "index"
    idx.mkdir(parents=True)
    any_py = {"torchao": "0.18.0", "transformer_engine": TE, "nvdlfw_inspect": "0.2.2", "onnxscript": "0.7.2",
              "onnx_ir": "1.1.0", "einops": "0.8.2", "typing_extensions": "4.16.0", "typing_inspection": "0.4.5",
              "annotated_types": "0.8.0", "datasets": "5.2.0", "dill": "0.4.1", "multiprocess": "0.70.19",
              "nvidia_cudnn_frontend": "1.32.0"}
    for name, version in any_py.items():
        fakes.make_wheel(idx, name, version, {f"{name}/__init__.py": ""})
    fakes.make_wheel(idx, "pydantic", "2.14.4", {"pydantic/__init__.py": ""}, requires=(
        "annotated-types>=0.6.0", f"pydantic-core=={CORE}", "typing-extensions>=4.16.0", "typing-inspection>=0.4.4",
        "email-validator>=2.0.0; extra == 'email'"))
    for plat in (X86, ARM):
        for name, version in (("pydantic_core", CORE), ("pydantic_core", "2.50.6"), ("onnx", "1.23.2"),
                              ("protobuf", "7.36.2"), ("ml_dtypes", "0.6.0")):
            if plat == ARM and name == "ml_dtypes" and not arm_ml_dtypes:
                continue
            fakes.make_wheel(idx, name, version, {f"{name}/{plat}.py": ""}, tag=f"cp312-cp312-{plat}")
        if plat == X86 or arm_core:
            fakes.make_wheel(idx, "transformer_engine_cu13", TE, {
                "transformer_engine/__init__.py": "", LIB: fakes.fatbin_library(), "transformer_engine/x.py": "x = 1\n"},
                tag=f"py3-none-{plat}")
    fakes.sdist(idx, root / "build_log.jsonl", version=TE)
    return idx


def make_kit(idx: Path, *args: str) -> subprocess.CompletedProcess:
    """make_kit.sh with pip reading only the stub folder (no configuration file, no index)."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(idx),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHON": sys.executable}
    env.pop("PIP_CONSTRAINT", None)
    return subprocess.run(["bash", str(MAKE_KIT), *args], capture_output=True, text=True, timeout=300, env=env)


def names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.mark.slow
def test_the_builder_makes_a_kit_for_real_from_stub_wheels(tmp_path):
    idx = stub_index(tmp_path)
    ext = fakes.te_torch_wheel(tmp_path, "2.11.0+cu130", version=TE, tag="cp312-cp312-linux_x86_64")
    out, rec = tmp_path / "kit", tmp_path / "record.json"
    proc = make_kit(idx, str(out), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90",
                    "--te-torch-wheel", str(ext), "--record", str(rec))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    files = names(out)
    assert f"pydantic_core-{CORE}-cp312-cp312-{X86}.whl" in files  # pydantic's own pin, not the newer 2.50.6
    assert not any("2.50.6" in f or "datasets" in f or "cudnn" in f for f in files)  # optional groups stay out
    assert {f"transformer_engine_torch-{TE}.tar.gz", ext.name, f"transformer_engine_cu13-{TE}-py3-none-{X86}.whl",
            "einops-0.8.2-py3-none-any.whl", "MANIFEST.json"} <= files
    assert kit.verify(out)["target"]["versions"]["pydantic_core"] == CORE
    # the core library pruned inside its wheel: only the sm_90 entry kept, every other member as it was, RECORD true
    with zipfile.ZipFile(out / f"transformer_engine_cu13-{TE}-py3-none-{X86}.whl") as z:
        lib, record = z.read(LIB), z.read(f"transformer_engine_cu13-{TE}.dist-info/RECORD").decode()
        assert z.read("transformer_engine/x.py") == b"x = 1\n"
    assert bytes([90]) * 64 in lib and not any(bytes([a]) * 64 in lib for a in (75, 100, 120))
    digest = base64.urlsafe_b64encode(hashlib.sha256(lib).digest()).rstrip(b"=").decode()
    assert f"{LIB},sha256={digest},{len(lib)}" in record.splitlines()
    assert "kept 0.0 MB of GPU code for sm_90" in proc.stdout and "in all (" in proc.stdout
    r = json.loads(rec.read_text())
    assert r["kit_bytes"] == sum(r["files"].values()) == sum(f.stat().st_size for f in out.iterdir()
                                                              if f.name != "MANIFEST.json")
    assert r["total_bytes"] == r["kit_bytes"] + r["repo_bytes"] and r["fits"]
    assert str(tmp_path) not in rec.read_text() and ext.name in r["command"]  # file names only, no paths
    # built again into the same kit: replaced whole, a TE extension compiled on a node (built/) kept
    (out / "built" / "k").mkdir(parents=True)
    (out / "built" / "k" / "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl").write_bytes(b"node")
    proc = make_kit(idx, str(out), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_100", "--with", "datasets")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ext.name not in names(out) and "datasets-5.2.0-py3-none-any.whl" in names(out)
    assert kit.verify(out)["files"]["built/k/transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl"]
    with zipfile.ZipFile(out / f"transformer_engine_cu13-{TE}-py3-none-{X86}.whl") as z:
        assert bytes([100]) * 64 in z.read(LIB) and bytes([90]) * 64 not in z.read(LIB)
    assert not list(tmp_path.glob(".make_kit-*")) and not (tmp_path / "kit.old").exists()


@pytest.mark.slow
def test_an_arm64_kit_picks_aarch64_wheels_and_says_where_te_has_none(tmp_path):
    """--platform aarch64 from this x86 machine: every download asks for manylinux aarch64, so the aarch64
    pydantic_core and onnx come; TE's core wheel without an aarch64 build leaves TE out with a message naming the
    image's TE, and the manifest says so; a required wheel without an aarch64 build stops the build, named."""
    idx = stub_index(tmp_path, arm_core=False)
    out = tmp_path / "arm"
    proc = make_kit(idx, str(out), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_100", "--platform", "aarch64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = names(out)
    assert f"pydantic_core-{CORE}-cp312-cp312-{ARM}.whl" in files and f"onnx-1.23.2-cp312-cp312-{ARM}.whl" in files
    assert not any(X86 in f or f.startswith("transformer_engine") for f in files)
    target = kit.verify(out)["target"]
    assert target["platform"] == "aarch64" and target["te"] is None
    why = target["missing"][f"transformer_engine_cu13=={TE}"]
    assert "has no aarch64 wheel for Python 3.12" in why and "NGC PyTorch image" in why and "#3309" in why
    assert "not in the kit: transformer_engine_cu13==2.20.2" in proc.stdout
    bad = stub_index(tmp_path / "b", arm_ml_dtypes=False)
    proc = make_kit(bad, str(tmp_path / "arm2"), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_100",
                    "--platform", "aarch64")
    assert proc.returncode == 2 and "no wheel for ml_dtypes (aarch64, Python 3.12)" in proc.stderr
    assert not (tmp_path / "arm2").exists()


def test_the_platform_reaches_every_download_and_te_is_left_out_on_request(tmp_path):
    proc = make_kit(tmp_path, str(tmp_path / "k"), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_100",
                    "--platform", "aarch64", "--with", "datasets", "--with", "s3", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    downloads = [x for x in proc.stdout.splitlines() if " pip download " in x]
    assert len(downloads) == 2  # every group in one call, then TE's core (pydantic's needs: read from its wheel)
    assert "# then pydantic==2.14.4's own Requires-Dist (pydantic-core==...) the same way" in proc.stdout
    assert all("--platform manylinux_2_28_aarch64" in x and "x86_64" not in x and "--python-version 3.12" in x
               for x in downloads)
    assert all(s in downloads[0] for s in ("torchao==0.18.0", "transformer_engine==2.20.2", "pydantic==2.14.4",
                                           "onnxscript", "datasets", "multiprocess", "s3torchconnector==1.5.0",
                                           "s3torchconnectorclient==1.5.0", "tenacity"))
    assert "transformer_engine_cu13==2.20.2" in downloads[-1] and "wheelzip.py prune" in proc.stdout
    assert "pip's own finder: transformer_engine_torch==2.20.2" in proc.stdout
    assert not (tmp_path / "k").exists()
    proc = make_kit(tmp_path, str(tmp_path / "k"), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_100",
                    "--te", "none", "--without", "onnx", "--dry-run")
    assert proc.returncode == 0 and "transformer_engine" not in proc.stdout and "onnx" not in proc.stdout


@pytest.mark.parametrize("args,message", [
    ([], "the following arguments are required: DIR"),
    (["K", "--torch", "2.11.0", "--arch", "sm_90"], "required: --python"),
    (["K", "--python", "312", "--torch", "2.11.0", "--arch", "sm_90"], "--python '312': expected the node's Python"),
    (["K", "--python", "3.12", "--torch", "2.11", "--arch", "sm_90"], "--torch '2.11': expected"),
    (["K", "--python", "3.12", "--torch", "2.11.0"], "required: --arch"),
    (["K", "--python", "3.12", "--torch", "2.11.0", "--arch", "90"], "--arch '90': expected sm_NN"),
    (["K", "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90", "--cuda", "11"], "--cuda: invalid choice"),
    (["K", "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90", "--platform", "arm64"],
     "--platform: invalid choice: 'arm64' (choose from 'x86_64', 'aarch64')"),
    (["K", "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90", "--with", "onnx", "--without", "onnx"],
     "--with and --without both name onnx"),
    (["K", "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90", "--fast"], "unrecognized arguments: --fast"),
    (["K", "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90", "--te", "none", "--build-te"],
     "--te none leaves TE out"),
    (["K", "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_100", "--platform", "aarch64", "--build-te"],
     "--build-te compiles for this machine's CPU (x86_64), not aarch64"),
])
def test_make_kit_names_bad_arguments(tmp_path, args, message):
    proc = make_kit(tmp_path, *[str(tmp_path / a) if a == "K" else a for a in args])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "K").exists()


def test_a_te_torch_wheel_for_another_python_or_te_is_refused(tmp_path):
    wrong = fakes.te_torch_wheel(tmp_path, "2.11.0", version="2.19.0", tag="cp312-cp312-linux_x86_64")
    proc = make_kit(tmp_path, str(tmp_path / "k"), "--python", "3.12", "--torch", "2.11.0", "--arch", "sm_90",
                    "--te-torch-wheel", str(wrong), "--te", "2.20.2", "--without", "onnx", "--dry-run")
    assert proc.returncode == 2 and "expected a file transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl" \
        in proc.stderr


def test_the_python_for_a_build_is_one_that_runs(tmp_path, monkeypatch):
    """A pyenv shim named python3.12 on PATH may not run: the next candidate (pyenv's versions) is taken."""
    shim = tmp_path / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\necho 'pyenv: command not found' >&2; exit 127\n")
    shim.chmod(0o755)
    home = tmp_path / "pyenv"
    real = home / "versions" / f"{sys.version_info[0]}.{sys.version_info[1]}.9" / "bin" / "python"
    real.parent.mkdir(parents=True)
    real.symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{shim.parent}:/usr/bin:/bin")
    monkeypatch.setenv("PYENV_ROOT", str(home))
    monkeypatch.delenv("PYTHON_BIN", raising=False)
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert te_wheel.find_python(version) == str(real)
    assert te_wheel.find_python("3.99") is None


def test_the_committed_record_of_a_real_build_fits_with_todays_working_tree():
    """docs/kit-build.json: a real build (make_kit.sh, this repository's builder) of the first visit's kit. Its
    files are what the builder makes for its groups, and with the working tree as it is now it stays inside the
    60 MiB budget (the tree grows: this fails before a command to the node would carry too much)."""
    rec = json.loads((REPO / "docs" / "kit-build.json").read_text())
    files = rec["files"]
    assert rec["kit_bytes"] == sum(files.values()) and rec["total_bytes"] == rec["kit_bytes"] + rec["repo_bytes"]
    prefixes = {n.split("-")[0] for n in files}
    assert {"torchao", "transformer_engine", "transformer_engine_cu13", "transformer_engine_torch", "pydantic",
            "pydantic_core", "onnx", "onnxscript", "einops"} <= prefixes
    assert rec["target"]["versions"]["pydantic_core"] == next(n for n in files if n.startswith("pydantic_core-")).split("-")[1]
    assert rec["target"]["platform"] == "x86_64" and rec["target"]["arch"] == "sm_90" and rec["target"]["te"] == TE
    assert rec["kit_bytes"] + build_kit.repo_bytes(REPO) <= build_kit.BUDGET_BYTES
