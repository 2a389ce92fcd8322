"""Run at the start of every Python process the tests start (tests/conftest.py puts this folder first on PYTHONPATH
and names a cache folder in LLAMA_FP8_IMPORT_CACHE): transformers' import table computed once per test run, not
once per process.

``import transformers`` builds its lazy import table by reading every file under ``transformers/models`` (about
1,700 of them, each read and scanned for its ``__all__`` and ``@requires``): 0.5 CPU s of the 1.9 s that
``from transformers import LlamaForCausalLM`` costs here, in each of the 400-odd processes of a run of make test
that build a model (every training rank). The first process of a run stores the table it computed as JSON in the
cache folder; the others read it. The table is transformers' own, unchanged (tests/test_suite_env.py compares
it with a fresh scan). Anything unexpected (another transformers, an unreadable or half-written cache file) falls
back to transformers' own scan: the hook can only make a process slower than it saves, never different.

Nothing here is part of the product: users' processes scan as transformers does."""

from __future__ import annotations

import hashlib
import json
import os
import sys

CACHE_ENV = "LLAMA_FP8_IMPORT_CACHE"
MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
MAX_BYTES = 16 << 20  # the table is about 0.2 MB; a larger file is not one this hook wrote


def encode(structure: dict) -> dict:
    """transformers' table ({folder: table} and {frozenset(backends): {module: set(names)}} mixed) as JSON."""
    out: dict = {"dirs": {}, "files": []}
    for key, value in structure.items():
        if isinstance(key, frozenset):
            out["files"].append([sorted(key), {module: sorted(names) for module, names in value.items()}])
        else:
            out["dirs"][key] = encode(value)
    return out


def decode(data: dict) -> dict:
    structure: dict = {name: decode(sub) for name, sub in data["dirs"].items()}
    for backends, modules in data["files"]:
        structure[frozenset(backends)] = {module: set(names) for module, names in modules.items()}
    return structure


def cache_file(folder: str, models: str) -> str:
    """One file per transformers install: the models folder's path, inode and time of change name it."""
    st = os.stat(models)
    key = f"{os.path.realpath(models)}|{st.st_ino}|{st.st_mtime_ns}".encode()
    return os.path.join(folder, f"transformers-{hashlib.sha256(key).hexdigest()[:16]}.json")


def read(path: str) -> dict | None:
    try:
        if os.path.getsize(path) > MAX_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            return decode(json.load(f))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # absent, half-written or not ours: scan


def write(path: str, structure: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:  # not into a folder that is gone (the run that made it has ended): nothing made outside it
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(encode(structure), f)
        os.replace(tmp, path)  # whole or not at all, for the processes reading it at the same time
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def cached(scan, folder: str):
    """``scan`` (transformers' function) for the models folder from the cache, for any other path as it is."""

    def create_import_structure_from_path(module_path):
        path = str(module_path)
        if os.path.isfile(path):
            path = os.path.dirname(path)
        if os.path.basename(path) != "models" or os.path.basename(os.path.dirname(path)) != "transformers":
            return scan(module_path)  # a model's own folder (the scan of the models folder recurses through here)
        try:
            where = cache_file(folder, path)
        except OSError:
            return scan(module_path)
        structure = read(where)
        if structure is None:
            structure = scan(module_path)
            write(where, structure)
        return structure

    create_import_structure_from_path.__wrapped__ = scan
    return create_import_structure_from_path


class _Hook:
    """A meta path finder that lets transformers' import_utils load as usual, then replaces its scan."""

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # once, and not for the lookup below
        import importlib.util

        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        load = loader.exec_module

        def exec_module(module):
            load(module)
            scan = getattr(module, FUNCTION, None)
            if callable(scan):
                setattr(module, FUNCTION, cached(scan, self.folder))

        loader.exec_module = exec_module
        return spec


if os.environ.get(CACHE_ENV) and MODULE not in sys.modules:
    sys.meta_path.insert(0, _Hook(os.environ[CACHE_ENV]))
