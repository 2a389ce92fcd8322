"""Readers of one slot's documents: ``MapDocReader`` (map-style: exact per-epoch shuffle) and
``StreamDocReader`` (a stream, in stored order). Both hand out documents in chunks of strings together with
a small resumable position; ``packing.py`` turns them into packed token blocks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


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
