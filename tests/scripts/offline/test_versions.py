"""The versions block: printed in full without a GPU (and without torch), GPU fields from nvidia-smi when there
is one, and a results key that changes with the GPU architecture or a library version and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import versions

SCRIPTS = Path(versions.__file__).resolve().parent


def test_block_without_a_gpu_prints_every_field(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, versions.__file__, "--json", str(tmp_path / "v.json")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "== versions" and len(lines) == 2 + len(versions.FIELDS)
    for label in ("GPU", "driver", "compute capability", "CUDA (torch)", "torch", "Transformer Engine", "torchao",
                  "transformers", "cuDNN", "NCCL"):
        assert any(line.startswith(label + " ") for line in lines), label
    v = json.loads((tmp_path / "v.json").read_text())
    assert (v["gpu"], v["driver"], v["capability"]) == ("no GPU", "no GPU", "no GPU")
    assert v["nvcc"] == "not installed" and v["key"] == versions.key(v) and v["key"].startswith("nogpu-")


def test_a_cpu_build_of_torch_is_read_without_its_import():
    """A CPU build of torch (make test's venv): its entries are read from torch/version.py, torch is not imported (1-2
    s of every block before), and they are the ones torch's import gives. A CUDA build is asked by its import."""
    code = ("import json, sys, versions; v = versions.torch_versions(); "
            "print(json.dumps([v, 'torch' in sys.modules, versions.torch_imported(), versions.torch_build()]))")
    proc = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(SCRIPTS)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    read, imported_before, imported, build = json.loads(proc.stdout.splitlines()[-1])
    gpu_build = bool(build["cuda"] or build["hip"] or build["rocm"])
    assert imported_before is gpu_build and read == imported, (read, imported)
    assert build["__version__"] == read["torch"] and (read["cuda"] == "none (CPU build of torch)") is not gpu_build


def test_without_torch_the_block_still_prints(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    v = versions.collect()
    assert v["torch"] == "not installed" and v["cudnn"] == "n/a" and v["gpu"] == "no GPU"
    assert "torch               not installed" in versions.format_block(v)


def test_gpu_fields_come_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    v = versions.collect()
    assert (v["gpu"], v["driver"], v["gpu_memory"]) == ("NVIDIA H100 80GB HBM3", "580.159.04", "81559 MiB")
    assert versions.key({**v, "capability": "9.0"}).startswith("sm90-")


def test_the_key_follows_the_gpu_architecture_and_library_versions_only():
    """A command of a visit that lands on an H200 instead of an H100, or on another driver, goes on with the plan:
    neither the GPU's name nor the driver is in the key (each record names them)."""
    h100 = {name: "x" for name, _ in versions.FIELDS} | {"capability": "9.0", "gpu": "NVIDIA H100 80GB HBM3",
                                                          "driver": "580.159.04", "gpu_memory": "81559 MiB"}
    k = versions.key(h100)
    h200 = {**h100, "gpu": "NVIDIA H200", "driver": "575.57.08", "gpu_memory": "143771 MiB"}
    assert versions.key(h200) == k and k.startswith("sm90-")
    assert versions.key({**h100, "python": "3.13", "nvcc": "12.9"}) == k
    assert versions.key({**h100, "capability": "10.0"}).startswith("sm100-")
    for name in versions.KEY_FIELDS:
        assert versions.key({**h100, name: "y"}) != k, name


def test_a_te_extension_installed_after_a_failed_import_starts_its_units_over():
    """When TE's torch extension did not import, the TE value tests of that command are recorded skipped (final);
    once it is compiled and installed, the next command must not take those records as done."""
    before = {name: "x" for name, _ in versions.FIELDS} | {"capability": "9.0",
                                                            "transformer_engine_torch": versions.MISSING}
    assert versions.key({**before, "transformer_engine_torch": "2.20.2"}) != versions.key(before)
