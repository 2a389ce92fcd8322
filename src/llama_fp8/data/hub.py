"""Hugging Face Hub datasets: the train (and validation) split of a hub dataset, streamed when
``--streaming=1`` and read in stored order per rank shard. Not scanned up front: documents without text
are skipped as they come. A network error (a Hub answering 429 or 503) is tried again with a backoff, then
raised as a transient failure (exit 75: restarted), never as a bad --dataset."""

from __future__ import annotations

from typing import Any

from llama_fp8 import faults


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
    try:  # a Hub answering 429 or 503, a connection reset: tried again with a backoff
        out = dict(faults.backoff(lambda: datasets.load_dataset(key.dataset, key.config_name, **kwargs),
                                  f"--dataset={key.dataset!r}"))
    except Exception as e:  # DatasetNotFoundError, unknown config, offline mode, ...
        transient = faults.as_transient(e)
        if transient is not None:  # still the network after the backoff: exit 75, restarted, not a bad flag
            raise transient from e
        raise ValueError(f"--dataset={key.dataset!r} (--dataset_config_name={key.config_name!r}) is "
                         f"neither a local path nor a loadable Hugging Face Hub dataset: "
                         f"{type(e).__name__}: {e}") from e
    if key.val_data_files and not key.data_files:
        try:  # a list of files is one split, named "train" by `datasets`
            out["validation"] = faults.backoff(lambda: datasets.load_dataset(
                key.dataset, key.config_name, split="train", data_files=_hub_files(key.val_data_files),
                streaming=key.streaming), f"--val_data_files={key.val_data_files!r}")
        except Exception as e:
            transient = faults.as_transient(e)
            if transient is not None:
                raise transient from e
            raise ValueError(f"--val_data_files={key.val_data_files!r} cannot be loaded from "
                             f"--dataset={key.dataset!r}: {type(e).__name__}: {e}") from e
    return out
