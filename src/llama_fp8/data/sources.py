"""Where documents come from: local files and folders, Hugging Face Hub datasets, and the tokenizer.

A *document* is one record of the text column: a JSON line, a parquet/arrow row, or one line of a
``.txt`` file (the ``datasets`` "text" builder's default; empty lines are skipped when packing).

Local sources are always opened map-style (``datasets`` converts them once to a memory-mapped arrow
cache), which gives random access: an exact per-epoch shuffle and an exact ``--val_fraction``
hold-out. Hub datasets stream when ``--streaming=1`` and are read in stored order per rank shard.

Readers (``MapDocReader``, ``StreamDocReader``) hand out documents in chunks of strings together
with a small resumable position; ``packing.py`` turns them into packed token blocks.

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
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# File suffix -> `datasets` packaged builder.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text",
            ".arrow": "arrow", ".csv": "csv"}
# The held-out documents of --val_fraction depend on this fixed seed, not on --seed, so runs with
# different seeds are evaluated on the same documents.
VAL_SPLIT_SEED = 0x5EED


@dataclass(frozen=True)
class SourceKey:
    """The config fields that define the document sources (hashable, so opened sources are cached)."""

    dataset: str
    config_name: str | None
    text_field: str
    data_files: str | None
    val_data_files: str | None
    val_fraction: float
    streaming: bool

    @classmethod
    def from_cfg(cls, cfg: Any) -> SourceKey:
        """Read the source fields of the training config."""
        return cls(str(cfg.dataset), cfg.dataset_config_name, cfg.text_field, cfg.data_files,
                   cfg.val_data_files, float(cfg.val_fraction), bool(cfg.streaming))


@dataclass
class Sources:
    """Opened train/validation datasets. ``*_ids`` select documents of a map-style dataset (None = all)."""

    train: Any  # datasets.Dataset | datasets.IterableDataset
    train_ids: np.ndarray | None
    val: Any | None
    val_ids: np.ndarray | None
    text_field: str

    def n_docs(self, split: str) -> int | None:
        """Documents in the "train" or "validation" split, or None for a stream of unknown length."""
        ds, ids = (self.train, self.train_ids) if split == "train" else (self.val, self.val_ids)
        return len(ids) if ids is not None else getattr(ds, "num_rows", None)


def is_local(dataset: str) -> bool:
    """True if --dataset names a local path (existing, or spelled like a path) rather than a hub id."""
    return (os.path.exists(dataset) or dataset.startswith(("/", "./", "../", "~"))
            or Path(dataset).suffix in BUILDERS)


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


def _local_split_files(key: SourceKey) -> dict[str, list[str]]:
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


def _load_local(key: SourceKey) -> dict[str, Any]:
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


def _hub_files(files: str) -> list[str]:
    return [f.strip() for f in files.split(",") if f.strip()]


def _load_hub(key: SourceKey) -> dict[str, Any]:
    """Open the train (and validation, if any) split of a hub dataset.

    --data_files replaces the hub's splits; --val_data_files replaces (or adds) only the validation split.
    """
    import datasets

    kwargs: dict[str, Any] = {"streaming": key.streaming}
    if key.data_files:
        kwargs["data_files"] = {"train": _hub_files(key.data_files)}
        if key.val_data_files:
            kwargs["data_files"]["validation"] = _hub_files(key.val_data_files)
    try:
        out = dict(datasets.load_dataset(key.dataset, key.config_name, **kwargs))
    except Exception as e:  # DatasetNotFoundError, unknown config, offline mode, ...
        raise ValueError(f"--dataset={key.dataset!r} (--dataset_config_name={key.config_name!r}) is "
                         f"neither a local path nor a loadable Hugging Face Hub dataset: "
                         f"{type(e).__name__}: {e}") from e
    if key.val_data_files and not key.data_files:
        try:  # a list of files is one split, named "train" by `datasets`
            out["validation"] = datasets.load_dataset(key.dataset, key.config_name, split="train",
                                                      data_files=_hub_files(key.val_data_files),
                                                      streaming=key.streaming)
        except Exception as e:
            raise ValueError(f"--val_data_files={key.val_data_files!r} cannot be loaded from "
                             f"--dataset={key.dataset!r}: {type(e).__name__}: {e}") from e
    return out


def _check_text_field(ds: Any, key: SourceKey, split: str) -> None:
    columns = ds.column_names
    if columns is None:  # streaming dataset without declared features: look at one record
        columns = list(next(iter(ds.take(1)), {}).keys())
    if key.text_field not in columns:
        raise ValueError(f"--text_field={key.text_field!r} is not a column of the {split!r} split of "
                         f"--dataset={key.dataset!r}; columns: {columns}")
    feature = (getattr(ds, "features", None) or {}).get(key.text_field)
    if feature is not None and getattr(feature, "dtype", "string") not in ("string", "large_string"):
        raise ValueError(f"--text_field={key.text_field!r} of the {split!r} split of --dataset={key.dataset!r} "
                         f"holds {feature.dtype}, not text")
    table = getattr(ds, "data", None)  # map-style: count documents without text in the arrow column
    if table is not None and hasattr(table, "column"):
        missing = table.column(key.text_field).null_count
        if missing:
            log.warning("--dataset=%s: %d of %d %s documents have no %r (the key is missing or null): skipped",
                        key.dataset, missing, len(ds), "training" if split == "train" else split, key.text_field)


def _hold_out(n_docs: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (train_ids, val_ids) split of ``n_docs`` documents; val gets ``fraction``."""
    if n_docs < 2:
        raise ValueError(f"--val_fraction={fraction} needs at least 2 documents, the source has {n_docs}")
    n_val = min(n_docs - 1, max(1, round(n_docs * fraction)))
    perm = np.random.default_rng(VAL_SPLIT_SEED).permutation(n_docs)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


@lru_cache(maxsize=8)
def open_sources(key: SourceKey) -> Sources:
    """Open and check the sources of a config; raises ValueError naming the flag on any problem."""
    if not 0.0 <= key.val_fraction < 1.0:
        raise ValueError(f"--val_fraction={key.val_fraction} must be in [0, 1)")
    local = is_local(key.dataset)
    splits = _load_local(key) if local else _load_hub(key)
    if "train" not in splits:
        raise ValueError(f"--dataset={key.dataset!r} has no 'train' split; splits: {sorted(splits)}")
    train, val = splits["train"], splits.get("validation")
    for name, ds in (("train", train), ("validation", val)):
        if ds is not None:
            _check_text_field(ds, key, name)
    train_ids = val_ids = None
    if val is None and key.val_fraction > 0:
        if not hasattr(train, "__len__"):
            raise ValueError(f"--val_fraction needs a map-style source, but --dataset={key.dataset!r} "
                             "streams (set --streaming=0 or give --val_data_files)")
        train_ids, val_ids = _hold_out(len(train), key.val_fraction)
        val = train
    return Sources(train, train_ids, val, val_ids, key.text_field)


@lru_cache(maxsize=4)
def load_tokenizer(name: str) -> Any:
    """AutoTokenizer from a local folder or hub id, with truncation/padding of the backend off."""
    from transformers import AutoTokenizer

    if is_local(name) and not os.path.isdir(os.path.expanduser(name)):
        raise ValueError(f"--tokenizer={name!r}: no such directory")
    try:
        tok = AutoTokenizer.from_pretrained(os.path.expanduser(name) if is_local(name) else name)
    except Exception as e:
        raise ValueError(f"--tokenizer={name!r} cannot be loaded: {type(e).__name__}: {e}") from e
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # packing needs whole documents, never truncated or padded ones
        backend.no_truncation()
        backend.no_padding()
    return tok


def check_tokenizer(tok: Any, name: str, vocab_size: int | None) -> None:
    """The packer needs an EOS token and ids that fit the model's embedding (None: not checked)."""
    if tok.eos_token_id is None:
        raise ValueError(f"--tokenizer={name!r} defines no EOS token; packing separates documents "
                         "with EOS (set eos_token in its tokenizer_config.json)")
    if vocab_size is not None and len(tok) > vocab_size:
        raise ValueError(f"--tokenizer={name!r} has {len(tok)} tokens, more than the model's "
                         f"vocab_size={vocab_size}; use a model preset with vocab_size >= {len(tok)}")


class MapDocReader:
    """Documents of one reader slot of a map-style dataset; reshuffled (or not) every epoch.

    Slot ``s`` of ``n`` owns documents s, s+n, s+2n, ... of the (optionally id-selected) dataset,
    so slots are disjoint. Position = {"epoch", "pos"}: next document of the epoch's order.
    """

    def __init__(self, ds: Any, ids: np.ndarray | None, field: str, slot: int, n_slots: int,
                 seed: int, shuffle: bool, chunk_docs: int) -> None:
        self._ds = ds.select_columns([field])
        self._field = field
        total = len(ids) if ids is not None else len(ds)
        mine = np.arange(slot, total, n_slots, dtype=np.int64)
        self._mine = ids[mine] if ids is not None else mine
        self._seed, self._slot, self._shuffle, self._chunk = seed, slot, shuffle, chunk_docs

    def __len__(self) -> int:
        return len(self._mine)

    def _order(self, epoch: int) -> np.ndarray:
        if not self._shuffle:
            return self._mine
        rng = np.random.default_rng([self._seed & (2**63 - 1), epoch, self._slot])
        return self._mine[rng.permutation(len(self._mine))]

    def read(self, state: dict | None, cycle: bool = True) -> Iterator[tuple[list[str], dict]]:
        """Yield (texts, position after them) from ``state`` on; forever if ``cycle``."""
        if len(self._mine) == 0:
            raise RuntimeError(f"reader slot {self._slot} owns no documents (the source is too small "
                               "for dp_world * max(1, num_workers) slots)")
        epoch, pos = (int(state["epoch"]), int(state["pos"])) if state else (0, 0)
        while True:
            order = self._order(epoch)
            while pos < len(order):
                # Sorted ids within a chunk read the arrow file in order; blocks are shuffled later.
                ids = np.sort(order[pos:pos + self._chunk])
                pos = min(pos + self._chunk, len(order))
                yield self._ds[ids][self._field], {"epoch": epoch, "pos": pos}
            if not cycle:
                return
            epoch, pos = epoch + 1, 0


class StreamDocReader:
    """Documents of one reader slot of a streaming dataset (``split_dataset_by_node``), in stored order.

    Position = {"epoch", "hf": IterableDataset.state_dict()}; exact because no shuffle buffer is used.
    """

    def __init__(self, ds: Any, field: str, slot: int, n_slots: int, chunk_docs: int) -> None:
        from datasets.distributed import split_dataset_by_node

        self._ds = split_dataset_by_node(ds.select_columns([field]), rank=slot, world_size=n_slots)
        self._field, self._slot, self._chunk = field, slot, chunk_docs

    def read(self, state: dict | None, cycle: bool = True) -> Iterator[tuple[list[str], dict]]:
        """Yield (texts, position after them) from ``state`` on; forever if ``cycle``."""
        epoch = int(state["epoch"]) if state else 0
        hf_state = state["hf"] if state else None
        while True:
            self._ds.set_epoch(epoch)
            if hf_state is not None:
                self._ds.load_state_dict(hf_state)
                hf_state = None
            n_read = 0
            for batch in self._ds.iter(batch_size=self._chunk):
                n_read += 1
                yield batch[self._field], {"epoch": epoch, "hf": self._ds.state_dict()}
            if not cycle:
                return
            if n_read == 0 and (state is None or int(state["epoch"]) != epoch):
                raise RuntimeError(f"reader slot {self._slot} got no documents in epoch {epoch}")
            epoch += 1
