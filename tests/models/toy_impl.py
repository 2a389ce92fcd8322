"""A third model implementation, defined here and nowhere else: a toy causal LM (embedding, residual MLP
blocks, head) registered through ``llama_fp8.models.register``. Run as a script under torchrun it
registers itself and trains through the real ``train`` entry point (test_registry.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from llama_fp8.models.spec import ModelImpl


class ToyBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.fc = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class ToyLM(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(ToyBlock(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        x = self.embed_tokens(input_ids)  # (B, T, H)
        for block in self.blocks:
            x = block(x)
        return SimpleNamespace(logits=self.head(x))  # (B, T, V)


class ToyImpl(ModelImpl):
    name = "toy"
    description = "a toy residual MLP LM (tests only)"
    auto_when = "never"

    def auto_eligible(self, device: torch.device) -> bool:
        return False

    def build(self, cfg) -> nn.Module:
        return ToyLM(cfg.vocab_size, cfg.hidden_width, cfg.num_layers)

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.blocks


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for dist_worker
    from dist_worker import run_rank
    from llama_fp8 import models

    models.register(ToyImpl())
    run_rank(Path(sys.argv[1]), sys.argv[2:])
