"""Interim synthetic source (replaced by data.py's): learnable, deterministic, world-size independent."""

from __future__ import annotations

import torch


class SyntheticLoader:
    """Batches of x_t = (a + b*t) mod V, one generator per global sample index."""

    def __init__(self, vocab: int, seq_len: int, batch: int, rank: int, world: int, seed: int, offset: int = 0):
        self.vocab, self.seq_len, self.batch, self.rank, self.world, self.seed = vocab, seq_len, batch, rank, world, seed
        self.step = 0
        self.offset = offset

    def _sample(self, g: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g + self.offset)
        a = torch.randint(0, self.vocab, (1,), generator=gen)
        b = torch.randint(1, 8, (1,), generator=gen)
        return (a + b * torch.arange(self.seq_len + 1)) % self.vocab

    def __iter__(self):
        while True:
            base = self.step * self.batch * self.world + self.rank * self.batch
            seqs = torch.stack([self._sample(base + i) for i in range(self.batch)])
            self.step += 1
            yield {"input_ids": seqs[:, :-1].contiguous(), "labels": seqs[:, 1:].contiguous()}

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
