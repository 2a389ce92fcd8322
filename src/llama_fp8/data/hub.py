"""Hugging Face Hub datasets: the train (and validation) split of a hub dataset, streamed when
``--streaming=1`` and read in stored order per rank shard. Not scanned up front: documents without text
are skipped as they come."""

from __future__ import annotations

from typing import Any


def _hub_files(files: str) -> list[str]:
    return [f.strip() for f in files.split(",") if f.strip()]


def load_hub(key) -> dict[str, Any]:
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
