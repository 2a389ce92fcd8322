"""Local data files: is a name a local path, which files a --dataset/--data_files/--val_data_files names,
and opening them map-style through ``datasets`` (which converts them once to a memory-mapped arrow cache).

Bad local data is found when the sources are opened, at start-up (docs/reliability.md):

- a file that cannot be read (permissions, a dangling symlink), malformed content (a line that is not
  JSON, bytes that are not UTF-8, a text field that is not a string): an error naming the file and
  line; nothing is trained on data that was silently cut short;
- an empty file: skipped, named and counted in a warning (an error if every file is empty);
- a document without the text field (key missing, or null): skipped, counted in a warning. Empty
  strings are skipped too (they hold no tokens). Hub datasets that stream are not scanned up front:
  their documents without text are skipped as they come.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# File suffix -> `datasets` packaged builder.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text",
            ".arrow": "arrow", ".csv": "csv"}


def is_local(name: str) -> bool:
    """True if a --dataset or --tokenizer value names a local path (existing, or spelled like a path: a
    leading /, ./, ../ or ~, or a data file suffix) rather than a hub id. The one test of it: training and
    preflight both ask here."""
    return (os.path.exists(os.path.expanduser(name)) or name.startswith(("/", "./", "../", "~"))
            or Path(name).suffix in BUILDERS)


def _supported(files: list[str]) -> list[str]:
    return [f for f in files if Path(f).suffix in BUILDERS and not Path(f).name.startswith(".")]


def expand_files(patterns: str, base: Path | None, flag: str) -> list[str]:
    """Comma-separated files, folders or globs (relative to ``base`` if given) -> sorted data files."""
    files: list[str] = []
    for pattern in (p.strip() for p in patterns.split(",")):
        if not pattern:
            continue
        path = Path(pattern).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        found: list[str] = []
        for match in sorted(glob.glob(str(path), recursive=True)):
            if os.path.isdir(match):
                found += _supported(sorted(glob.glob(os.path.join(match, "**", "*"), recursive=True)))
            else:
                found += _supported([match])
        if not found:
            raise ValueError(f"--{flag}: {pattern!r} matches no data file (looked for {path}; "
                             f"supported suffixes: {', '.join(sorted(BUILDERS))})")
        files += found
    return files


def _folder_splits(folder: Path) -> dict[str, list[str]]:
    """Split files of a folder by name, as `datasets` does (train*, validation*/valid*/dev*/val*)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    # `datasets` leaves out what it cannot stat, so a dangling link would silently shrink the data.
    for p in sorted(folder.rglob("*")):
        if p.suffix in BUILDERS and not p.name.startswith(".") and p.is_symlink() and not p.exists():
            raise ValueError(f"--dataset: {p}: cannot be read (a dangling symbolic link to {os.readlink(p)})")

    resolved = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    splits = {str(k): _supported(list(v)) for k, v in resolved.items()}
    if not splits.get("train"):
        raise ValueError(f"--dataset={str(folder)!r}: no data file found (supported suffixes: "
                         f"{', '.join(sorted(BUILDERS))})")
    return splits


def _builder_for(files: list[str], flag: str) -> str:
    builders = {BUILDERS[Path(f).suffix] for f in files}
    if len(builders) != 1:
        raise ValueError(f"--{flag}: files of different formats ({sorted(builders)}) in one split; "
                         "use one format per split")
    return builders.pop()


def _local_split_files(key) -> dict[str, list[str]]:
    """Resolve --dataset/--data_files/--val_data_files for a local source to {split: files}."""
    root = Path(key.dataset).expanduser()
    if not root.exists():
        raise ValueError(f"--dataset={key.dataset!r}: no such file or directory")
    if root.is_file():
        if key.data_files:
            raise ValueError(f"--data_files is only valid with a folder or hub --dataset, "
                             f"but --dataset={key.dataset!r} is a file")
        splits = {"train": expand_files(str(root), None, "dataset")}
    elif key.data_files:
        splits = {"train": expand_files(key.data_files, root, "data_files")}
    else:
        splits = {k: v for k, v in _folder_splits(root).items() if k in ("train", "validation") and v}
    if key.val_data_files:
        splits["validation"] = expand_files(key.val_data_files, root if root.is_dir() else None,
                                            "val_data_files")
    return splits


def load_local(key) -> dict[str, Any]:
    """Open a local source map-style: a `save_to_disk` folder, or files through a packaged builder."""
    import datasets

    root = Path(key.dataset).expanduser()
    if root.is_dir() and ((root / "state.json").exists() or (root / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(root))
        out = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
        if key.val_data_files:
            out["validation"] = _load_files(expand_files(key.val_data_files, root, "val_data_files"),
                                            "val_data_files", key.text_field)
        return out
    return {split: _load_files(files, "dataset" if split == "train" else "val_data_files", key.text_field)
            for split, files in _local_split_files(key).items()}


def _load_files(files: list[str], flag: str, field: str | None = None) -> Any:
    import datasets

    files = _nonempty(files, flag)
    try:
        ds = datasets.load_dataset(_builder_for(files, flag), data_files=files, split="train")
    except Exception as e:  # a parse error of a user file: report it as a config error, naming file and line
        where = _first_bad_record(files, field)
        if where:
            raise ValueError(f"--{flag}: {where}") from None
        raise ValueError(f"--{flag}: cannot read {files[:3]}{'...' if len(files) > 3 else ''}: "
                         f"{type(e).__name__}: {e}") from e
    if field in ds.column_names:
        # The JSON reader does not check UTF-8; a bad byte would stop training when its chunk is read. The
        # check is one vectorized pass over the text column (GB/s).
        import pyarrow as pa

        try:
            ds.data.column(field).validate(full=True)
        except pa.ArrowInvalid:
            raise ValueError(f"--{flag}: {_first_bad_record(files, field) or 'text that is not valid UTF-8'}") from None
    return ds


def _nonempty(files: list[str], flag: str) -> list[str]:
    """The files with data; unreadable ones are an error, empty ones a warning (all empty: an error)."""
    empty = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                if not fh.read(1):
                    empty.append(f)
        except OSError as e:
            raise ValueError(f"--{flag}: {f}: cannot be read ({e.strerror}); fix or remove it") from None
    if empty and len(empty) == len(files):
        raise ValueError(f"--{flag}: every data file is empty ({len(files)}: {', '.join(files[:5])}"
                         f"{', ...' if len(files) > 5 else ''}): no documents to train on")
    if empty:
        log.warning("--%s: skipping %d of %d data files: empty: %s", flag, len(empty), len(files),
                    ", ".join(empty[:5]) + (", ..." if len(empty) > 5 else ""))
    return [f for f in files if f not in set(empty)]


def _first_bad_record(files: list[str], field: str | None = None) -> str | None:
    """Where a text or JSON-lines file is malformed ("FILE line N: why"), or None. Only called after
    `datasets` failed on the files (it reports a row of an internal block, not the file's line)."""
    fields: dict[str, set] = {}
    for f in files:
        if Path(f).suffix not in (".jsonl", ".json", ".txt"):
            continue
        keys = fields.setdefault(f, set())
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return f"{f} line {n}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                if Path(f).suffix == ".txt" or not line.strip():
                    continue
                if Path(f).suffix == ".json" and n == 1 and line.lstrip().startswith("["):
                    break  # one JSON document, not JSON lines: `datasets` gave the reason
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    return f"{f} line {n}: not valid JSON: {e.msg} (column {e.colno})"
                keys.update(record if isinstance(record, dict) else ())
                value = record.get(field) if isinstance(record, dict) and field else None
                if isinstance(value, (int, float, bool, list, dict)):
                    kind = {bool: "a boolean", list: "a list", dict: "an object"}.get(type(value), "a number")
                    return f"{f} line {n}: {field!r} holds {kind}, not a string"
    first = next(iter(fields), None)
    for f, keys in fields.items():  # `datasets` needs the same fields in every JSON file of a split
        if Path(f).suffix != ".txt" and keys != fields[first]:
            return (f"{f} has the fields {sorted(keys)}, {first} has {sorted(fields[first])}: every JSON file "
                    f"of a split needs the same fields")
    return None
