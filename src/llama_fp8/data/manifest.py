"""The manifest of a tokenized corpus (``manifest.json``): what was tokenized with what, and every shard's counts,
sizes and SHA-256s. Written last by ``llama_fp8 tokenize`` (atomically), so a folder with a manifest is a finished
corpus; read here as hostile input: capped in size, every field of the type it should be, every shard name a plain
file name inside the corpus folder.

Example::

    {"format": "llama-fp8 tokenized corpus", "version": 1, "dtype": "uint16",
     "tokenizer": {"name": "/fsx/tok", "sha256": "...", "vocab_size": 32000, "bos_id": 1, "eos_id": 2},
     "source": {"dataset": "/fsx/raw", "text_field": "text", ...},
     "splits": {"train": {"documents": 1200, "tokens": 480000,
                          "shards": [{"name": "train-00000", "documents": 1200, "tokens": 480000,
                                      "bin_bytes": 960000, "idx_bytes": 24046, "bin_sha256": "...",
                                      "idx_sha256": "..."}]}}}
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from llama_fp8.data.indexed import CODE_OF, CorpusError

MANIFEST = "manifest.json"
FORMAT = "llama-fp8 tokenized corpus"
VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
MAX_SHARDS = 100_000  # per split
SPLITS = ("train", "validation")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHARD_INTS = ("documents", "tokens", "bin_bytes", "idx_bytes")
_SHA = re.compile(r"[0-9a-f]{64}")


def write_manifest(root: Path, body: dict) -> None:
    """Atomically: a reader sees no manifest or the whole one."""
    tmp = root / f".{MANIFEST}.tmp.{os.getpid()}"
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)


def read_manifest(root: Path) -> tuple[dict, bytes]:
    """The checked manifest of the corpus in ``root`` and its bytes (its identity); CorpusError naming it."""
    path = root / MANIFEST
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise CorpusError(f"{path}: {size} bytes, more than the {MAX_MANIFEST_BYTES >> 20} MiB a manifest may "
                              f"have; refused")
        raw = path.read_bytes()[:MAX_MANIFEST_BYTES]
    except OSError as e:
        raise CorpusError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorpusError(f"{path}: not valid JSON ({e}); refused") from None
    _check(body, path, root)
    return body, raw


def _bad(path: Path, why: str) -> CorpusError:
    return CorpusError(f"{path}: {why}; refused (a manifest is written by llama_fp8 tokenize: re-run it)")


def _check(body: Any, path: Path, root: Path) -> None:
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise _bad(path, f"not a manifest of a tokenized corpus (format {FORMAT!r} expected)")
    if body.get("version") != VERSION:
        raise _bad(path, f"version {body.get('version')!r}, this version of llama-fp8 reads version {VERSION}")
    if body.get("dtype") not in CODE_OF:
        raise _bad(path, f"dtype {body.get('dtype')!r} (valid: {sorted(CODE_OF)})")
    tok = body.get("tokenizer")
    if not isinstance(tok, dict) or not isinstance(tok.get("sha256"), str) or not _SHA.fullmatch(tok["sha256"]) \
            or not _is_int(tok.get("vocab_size"), 1):
        raise _bad(path, "field 'tokenizer' needs a sha256 and a vocab_size")
    splits = body.get("splits")
    if not isinstance(splits, dict) or "train" not in splits or set(splits) - set(SPLITS):
        raise _bad(path, f"field 'splits' must name 'train' (and optionally 'validation'), got "
                         f"{sorted(splits) if isinstance(splits, dict) else type(splits).__name__}")
    for name, split in splits.items():
        _check_split(split, f"splits.{name}", path, root)


def _check_split(split: Any, where: str, path: Path, root: Path) -> None:
    if not isinstance(split, dict) or not isinstance(split.get("shards"), list):
        raise _bad(path, f"field '{where}' needs a list of shards")
    shards = split["shards"]
    if not 0 < len(shards) <= MAX_SHARDS:
        raise _bad(path, f"field '{where}' has {len(shards)} shards (1 to {MAX_SHARDS})")
    seen = set()
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict) or not isinstance(shard.get("name"), str) or \
                not NAME.fullmatch(shard["name"]):
            raise _bad(path, f"shard {i} of '{where}' needs a plain file name (letters, digits, . _ -), got "
                             f"{shard.get('name') if isinstance(shard, dict) else shard!r}")
        if shard["name"] in seen:
            raise _bad(path, f"shard {shard['name']!r} is listed twice")
        seen.add(shard["name"])
        for key in _SHARD_INTS:
            if not _is_int(shard.get(key), 0):
                raise _bad(path, f"shard {shard['name']!r}: field {key!r} must be a count >= 0")
        for key in ("bin_sha256", "idx_sha256"):
            if not isinstance(shard.get(key), str) or not _SHA.fullmatch(shard[key]):
                raise _bad(path, f"shard {shard['name']!r}: field {key!r} must be a SHA-256 in hex")
        for suffix in (".bin", ".idx"):
            confined(root, shard["name"] + suffix, path)
    for key in ("documents", "tokens"):
        if split.get(key) != sum(s[key] for s in shards):
            raise _bad(path, f"field '{where}.{key}' is {split.get(key)!r}, its shards add up to "
                             f"{sum(s[key] for s in shards)}")


def confined(root: Path, name: str, named_by: Path) -> Path:
    """``root / name``, refused unless it resolves inside ``root`` (a symbolic link out of the corpus is refused)."""
    target = (root / name).resolve()
    if not target.is_relative_to(root.resolve()):
        raise _bad(named_by, f"{name!r} resolves to {target}, outside the corpus folder {root}")
    return root / name


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low
