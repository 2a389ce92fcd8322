"""Run at the start of every Python process the tests start (tests/conftest.py puts this folder first on PYTHONPATH
and names a cache folder in LLAMA_FP8_IMPORT_CACHE): transformers' import table computed once per test run, not
once per process.

``import transformers`` builds its lazy import table by reading every module under ``transformers/models`` (about
1,700 files, each scanned for its ``__all__`` and ``@requires``): 0.35 CPU s of the 2.6 s that a one-rank run of the
tiny model takes here, in each of the 400-odd processes of a run of make test that build a model (every training
rank). The first process of a run stores the table it computed as JSON in the cache folder; the others read it.
The table is transformers' own, its order kept (tests/test_suite_env.py compares it with a fresh scan). Anything
unexpected (another transformers whose table this cannot store exactly, an unreadable, half-written or foreign cache
file) falls back to transformers' own scan: the hook can make a process slower than it saves, never different.

Nothing here is part of the product: users' processes scan as transformers does. (On PYTHONPATH this module hides
any other sitecustomize, such as a Debian system Python's; the tests' own probes put theirs first.)"""

from __future__ import annotations

import hashlib
import json
import os
import sys

CACHE_ENV = "LLAMA_FP8_IMPORT_CACHE"
MODULE = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
FORMAT = "llama-fp8 tests: transformers import table, 1"
MAX_BYTES = 16 << 20  # the table is about 0.2 MB; a larger file is not one this hook wrote


class NotATable(ValueError):
    """What was read (or is to be written) is not a table of the shape this module stores."""


def encode(structure: dict) -> list:
    """transformers' table ({folder: table} and {frozenset(backends): {module: set(names)}} mixed in one dict, in
    transformers' order, which decides which module a name maps to when two export it) as JSON entries."""
    entries = []
    for key, value in structure.items():
        if isinstance(key, frozenset):
            entries.append(["file", sorted(key), {module: sorted(names) for module, names in value.items()}])
        elif isinstance(key, str) and isinstance(value, dict):
            entries.append(["dir", key, encode(value)])
        else:
            raise NotATable(f"an entry {key!r} of type {type(key).__name__}")
    return entries


def _strings(value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise NotATable("not a list of names")
    return value


def decode(entries) -> dict:
    if not isinstance(entries, list):
        raise NotATable("not a list of entries")
    structure: dict = {}
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3):
            raise NotATable("an entry is not [kind, key, value]")
        kind, key, value = entry
        if kind == "dir" and isinstance(key, str):
            structure[key] = decode(value)
        elif kind == "file" and isinstance(value, dict):
            structure[frozenset(_strings(key))] = {str(module): set(_strings(names)) for module, names in value.items()}
        else:
            raise NotATable(f"an entry of kind {kind!r}")
    return structure


def same(a: dict, b: dict) -> bool:
    """Equal and in the same order, all the way down (a folder's entries, a backend set's modules)."""
    if a != b or list(a) != list(b):
        return False
    return all(same(a[k], b[k]) if isinstance(k, str) else list(a[k]) == list(b[k]) for k in a)


def cache_file(folder: str, models: str) -> str:
    """One file per transformers install: the models folder's path, inode and time of change name it."""
    st = os.stat(models)
    key = f"{os.path.realpath(models)}|{st.st_ino}|{st.st_mtime_ns}".encode()
    return os.path.join(folder, f"transformers-{hashlib.sha256(key).hexdigest()[:16]}.json")


def read(path: str) -> list | None:
    """The stored entries, checked to decode; None where there is no usable file (then: scan)."""
    try:
        if os.path.getsize(path) > MAX_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not (isinstance(data, dict) and data.get("format") == FORMAT and data.get("entries")):
            return None  # not written by this module (an empty table is not transformers' either)
        decode(data["entries"])
        return data["entries"]
    except (OSError, ValueError, RecursionError):  # absent, half-written or not ours (NotATable is a ValueError)
        return None


def write(path: str, structure: dict) -> None:
    """Store ``structure`` only if it reads back exactly; whole or not at all (the other processes read meanwhile)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        entries = encode(structure)
        if not same(decode(entries), structure):
            return
        with open(tmp, "x", encoding="utf-8") as f:  # not into a folder that is gone (its run has ended)
            json.dump({"format": FORMAT, "entries": entries}, f)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - a table this cannot store is scanned by every process, as without the hook
        try:
            os.unlink(tmp)
        except OSError:
            pass


def cached(scan, folder: str):
    """``scan`` (transformers' function) for the models folder from the cache, for any other path as it is."""
    memo: dict[str, list] = {}  # entries read once per process; decoded afresh for each call (nothing shared)

    def create_import_structure_from_path(module_path):
        path = str(module_path)
        try:
            if os.path.isfile(path):
                path = os.path.dirname(path)
            if os.path.basename(path) != "models" or os.path.basename(os.path.dirname(path)) != "transformers":
                return scan(module_path)  # a model's own folder (the models folder's scan recurses through here)
            where = cache_file(folder, path)
            if where not in memo:
                entries = read(where)
                if entries is None:
                    structure = scan(module_path)
                    write(where, structure)
                    return structure
                memo[where] = entries
            return decode(memo[where])
        except Exception:  # noqa: BLE001 - whatever went wrong here, transformers' own scan
            return scan(module_path)

    create_import_structure_from_path.__wrapped__ = scan
    create_import_structure_from_path.import_cache = folder  # what the tests look for
    return create_import_structure_from_path


class _Hook:
    """A meta path finder that lets transformers' import_utils load as usual, then replaces its scan."""

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        try:
            sys.meta_path.remove(self)  # once, and not for the lookup below
        except ValueError:
            return None
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


if __name__ == "sitecustomize" and os.environ.get(CACHE_ENV) and MODULE not in sys.modules:  # not when a test loads it
    sys.meta_path.insert(0, _Hook(os.environ[CACHE_ENV]))
