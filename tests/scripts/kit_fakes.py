"""Stand-ins for what only a GPU node has, used by the tests of scripts/gpu/ and scripts/offline/: a wheel kit
whose Transformer Engine is a few lines that behave like the real one (its PyTorch extension imports only with the torch it was
built for), TE's source distribution (a real, offline-buildable sdist that records the build environment it
saw), a CUDA toolkit and nvidia-* header folders, and a network guard that logs and refuses every
connection. Our own code (install.py, verify.py) runs unchanged against them."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import struct
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import torch

TE_VERSION = "9.9.0"
CP = f"cp{sys.version_info[0]}{sys.version_info[1]}"
# The fake TE's PyTorch module: imports only when its extension was built for the torch in use, as a
# C++ extension built against another torch fails with "undefined symbol".
TE_PYTORCH = """\
import torch
from transformer_engine.wheel_lib import fake_ext
if fake_ext.BUILT_FOR != torch.__version__:
    raise ImportError("transformer_engine_torch: undefined symbol (built for torch %s)" % fake_ext.BUILT_FOR)
"""


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, name: str, version: str, files: dict[str, str | bytes], tag: str = "py3-none-any",
               requires: tuple[str, ...] = ()) -> Path:
    """A valid wheel (PEP 427) holding ``files``, its METADATA listing ``requires`` as Requires-Dist."""
    dist = f"{name}-{version}.dist-info"
    purelib = "true" if tag.endswith("-none-any") else "false"
    entries = {p: t if isinstance(t, bytes) else t.encode() for p, t in files.items()}
    entries[f"{dist}/METADATA"] = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode()
    entries[f"{dist}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: kit_fakes\nRoot-Is-Purelib: {purelib}\nTag: {tag}\n".encode()
    record = [f"{p},{_digest(t)},{len(t)}" for p, t in entries.items()] + [f"{dist}/RECORD,,"]
    entries[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in entries.items():
            z.writestr(p, t)
    return path


# --- a GPU library's fatbin, as TE's core library holds one ----------------------------------------------------
FATBIN_MAGIC = 0xBA55ED50


def fatbin_entry(arch: int, payload: bytes) -> bytes:
    """A fatbin entry: a 64-byte header (kind, flags, header size, payload size, ..., SM number at byte 28)."""
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, 2, 0x101, 64, len(payload))
    struct.pack_into("<I", head, 28, arch)
    return bytes(head) + payload


def fatbin_container(entries: list[bytes]) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(sections: dict[str, bytes]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """A minimal ELF64 little-endian file holding ``sections`` (and .shstrtab); returns it and where each lies."""
    names = [*sections, ".shstrtab"]
    strtab = b"\0" + b"".join(n.encode() + b"\0" for n in names)
    body, where = bytearray(64), {}
    for name, data in [*sections.items(), (".shstrtab", strtab)]:
        body += bytes(-len(body) % 8)
        where[name] = (len(body), len(data))
        body += data
    body += bytes(-len(body) % 8)
    shoff, headers, name_off = len(body), bytearray(64), 1
    for name in names:
        off, size = where[name]
        headers += struct.pack("<IIQQQQIIQQ", name_off, 3 if name == ".shstrtab" else 1, 0, 0, off, size, 0, 0, 8, 0)
        name_off += len(name) + 1
    body += headers
    body[:16] = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    struct.pack_into("<HHIQQQIHHHHHH", body, 16, 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(names) + 1, len(names))
    return bytes(body), where


def fatbin_library(archs: tuple[int, ...] = (75, 90, 100, 120), size: int = 64) -> bytes:
    """An ELF library with one fatbin container holding an entry of ``size`` bytes per architecture (the bytes of
    an entry are its architecture's number)."""
    fatbin = fatbin_container([fatbin_entry(a, bytes([a % 256]) * size) for a in archs])
    return elf({".text": b"\x90" * 32, ".nv_fatbin": fatbin})[0]


def te_torch_wheel(folder: Path, built_for: str, version: str = TE_VERSION, tag: str | None = None) -> Path:
    """A prebuilt transformer_engine_torch wheel whose extension was built for torch ``built_for``."""
    return make_wheel(folder, "transformer_engine_torch", version, {
        "transformer_engine/wheel_lib/__init__.py": "",
        "transformer_engine/wheel_lib/fake_ext.py": f"BUILT_FOR = {built_for!r}\n"},
        tag or f"{CP}-{CP}-linux_x86_64")


def sdist(folder: Path, build_log: Path, version: str = TE_VERSION) -> Path:
    """transformer_engine_torch-VERSION.tar.gz: builds a platform wheel for the torch it is built with,
    appends the build environment it saw to ``build_log`` (one JSON line per build)."""
    setup = textwrap.dedent(f"""\
        import json, os, pathlib, sys
        import torch
        from setuptools import setup
        from setuptools.dist import Distribution

        class Binary(Distribution):
            def has_ext_modules(self):
                return True

        keys = ("NVTE_FRAMEWORK", "NVTE_PYTORCH_FORCE_BUILD", "MAX_JOBS", "CUDA_HOME", "CPLUS_INCLUDE_PATH",
                "PIP_NO_INDEX")
        if "bdist_wheel" in sys.argv:  # pip also runs setup.py for the metadata: log the build only
            with open({str(build_log)!r}, "a") as f:
                f.write(json.dumps({{k: os.environ.get(k) for k in keys}}) + "\\n")
        pkg = pathlib.Path("transformer_engine/wheel_lib")
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "fake_ext.py").write_text("BUILT_FOR = %r\\n" % torch.__version__)
        setup(name="transformer_engine_torch", version={version!r}, packages=["transformer_engine.wheel_lib"],
              distclass=Binary)
        """)
    files = {"setup.py": setup, "pyproject.toml": '[build-system]\nrequires = ["setuptools"]\n'
             'build-backend = "setuptools.build_meta"\n',
             "PKG-INFO": f"Metadata-Version: 2.1\nName: transformer_engine_torch\nVersion: {version}\n"}
    path = folder / f"transformer_engine_torch-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"transformer_engine_torch-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def kit(folder: Path, *, prebuilt_for: str | None = None, with_sdist: bool = True,
        build_log: Path | None = None, skip: tuple[str, ...] = ()) -> Path:
    """A wheel kit like scripts/offline/make_kit.sh's: torchao, TE (Python part, core), optionally a prebuilt
    transformer_engine_torch for torch ``prebuilt_for`` and the sdist. ``skip``: names to leave out."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = {
        "torchao": ("0.0.1", {"torchao/__init__.py": "__version__ = '0.0.1'\n"}),
        "transformer_engine": (TE_VERSION, {"transformer_engine/__init__.py": "",
                                            "transformer_engine/pytorch/__init__.py": TE_PYTORCH}),
        "transformer_engine_cu13": (TE_VERSION, {"te_core_fake/__init__.py": ""}),
        "datasets_fake": ("1.0", {"datasets_fake/__init__.py": ""}),
        "nvidia_cudnn_frontend": ("1.32.0", {"include/cudnn_frontend.h": ""}),  # its headers: for a compile
    }
    for name, (version, files) in wheels.items():
        if name not in skip:
            make_wheel(folder, name, version, files)
    if prebuilt_for is not None:
        te_torch_wheel(folder, prebuilt_for)
    if with_sdist:
        sdist(folder, build_log or folder.parent / "build_log.jsonl")
    return folder


def toolchain(root: Path) -> dict[str, str]:
    """A CUDA toolkit (CUDA_HOME with bin/nvcc and include/), and nvidia-* pip header folders: the environment a GPU node provides for the compile."""
    cuda = root / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "include").mkdir()
    (cuda / "include" / "cuda_runtime.h").write_text("")
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    site = root / "node_site"
    for pkg, header in (("cudnn", "cudnn.h"), ("nccl", "nccl.h"), ("cu13", "cuda_runtime.h")):
        (site / "nvidia" / pkg / "include").mkdir(parents=True)
        (site / "nvidia" / pkg / "include" / header).write_text("")
    return {"CUDA_HOME": str(cuda), "PYTHONPATH": str(site)}


def net_guard(root: Path) -> tuple[dict[str, str], Path]:
    """A sitecustomize that every Python process started with this environment loads: it writes each
    attempted internet connection to the returned log file and refuses it."""
    guard = root / "netguard"
    guard.mkdir(parents=True)
    log = root / "net_attempts.log"
    (guard / "sitecustomize.py").write_text(textwrap.dedent(f"""\
        import socket
        _connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex

        def _refuse(sock, address):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                with open({str(log)!r}, "a") as f:
                    f.write(repr(address) + "\\n")
                raise OSError("network refused by the test's guard")

        def connect(self, address):
            _refuse(self, address)
            return _connect(self, address)

        def connect_ex(self, address):
            _refuse(self, address)
            return _connect_ex(self, address)

        socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
        """))
    return {"PYTHONPATH": str(guard)}, log


def merge_env(*parts: dict[str, str]) -> dict[str, str]:
    """os.environ plus ``parts``; PYTHONPATH entries are joined, not replaced."""
    env = dict(os.environ)
    paths = [p["PYTHONPATH"] for p in parts if "PYTHONPATH" in p]
    for p in parts:
        env.update({k: v for k, v in p.items() if k != "PYTHONPATH"})
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def torch_version() -> str:
    return torch.__version__


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
