"""What ``--doc_masking`` adds to a packed batch: each row's document boundaries as position ids that restart at 0 at
every document (and at the row's start), and no label that crosses a boundary.

A row is a block of T+1 tokens: ``input_ids = block[:-1]``, ``labels = block[1:]``. ``starts`` marks the block's
tokens that begin a document. Position t of the inputs gets ``position_ids[t] = t - (the last start <= t, or 0)``;
its label is the next token, which belongs to another document when t+1 is a start: that label becomes -100 (a
document never predicts the next one's first token), as Megatron's end-of-document loss mask does. The models build
their attention masks from the position ids (a new document where a position is 0): ``models/hf`` a block-diagonal
causal mask, ``models/te`` THD ``cu_seqlens``. Rotary embeddings depend on position differences only, so a document
cut at a row's start attends within itself exactly as it would at its true offset.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE = -100


def starts_after_eos(blocks: np.ndarray, eos_id: int) -> np.ndarray:
    """(B, T+1) bool: the token after an EOS begins a document (the on-the-fly packer ends every document with EOS)."""
    starts = np.zeros(blocks.shape, bool)
    starts[:, 1:] = blocks[:, :-1] == eos_id
    return starts


def starts_from_offsets(offsets: list[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """(B, T+1) bool from each row's document start offsets."""
    starts = np.zeros(shape, bool)
    for row, off in enumerate(offsets):
        starts[row, off] = True
    return starts


def doc_fields(blocks: np.ndarray, starts: np.ndarray) -> dict[str, torch.Tensor]:
    """The batch of ``blocks`` (B, T+1) with ``position_ids`` restarting at each document and crossing labels -100."""
    bsz, width = blocks.shape
    tokens = torch.from_numpy(np.ascontiguousarray(blocks, np.int64))
    marks = starts.copy()
    marks[:, 0] = True  # a row starts a (piece of a) document
    index = np.where(marks, np.arange(width), 0)
    last = np.maximum.accumulate(index, axis=1)
    positions = torch.from_numpy((np.arange(width) - last)[:, :-1].astype(np.int64))
    labels = tokens[:, 1:].clone()
    labels[torch.from_numpy(starts[:, 1:])] = IGNORE
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": labels, "position_ids": positions.contiguous()}
