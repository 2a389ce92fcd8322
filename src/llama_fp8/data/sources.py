"""Where documents come from: local files and folders, Hugging Face Hub datasets, and the tokenizer.

A *document* is one record of the text column: a JSON line, a parquet/arrow row, or one line of a
``.txt`` file (the ``datasets`` "text" builder's default; empty lines are skipped when packing).

Local sources are always opened map-style (``datasets`` converts them once to a memory-mapped arrow
cache), which gives random access: an exact per-epoch shuffle and an exact ``--val_fraction``
hold-out. Hub datasets stream when ``--streaming=1`` and are read in stored order per rank shard.

Local files are in ``files.py``, hub datasets in ``hub.py``, the tokenizer in ``tokenizer.py`` and the
document readers in ``readers.py``; this module opens and checks a config's sources and holds out the
``--val_fraction`` documents.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from llama_fp8.data.files import is_local, load_local
from llama_fp8.data.hub import load_hub

log = logging.getLogger(__name__)

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
    splits = load_local(key) if local else load_hub(key)
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
