"""What one forward/backward runs inside when the model is tensor- or context-parallel.

- Tensor parallelism (Hugging Face model): the LM head's logits stay sharded over the vocabulary, and the
  cross entropy is computed on the shards (``loss_parallel``), forward and backward.
- Context parallelism: each sequence of T tokens is cut into 2 x cp chunks and rank r of a CP group
  keeps chunks r and 2cp-1-r ("head-tail" load balancing: with a causal mask, early chunks are cheap and
  late ones expensive, so every rank gets one of each). Either torch's ``context_parallel`` does the
  cutting and routes SDPA to its ring attention (Hugging Face model), or we cut the batch ourselves and the
  model's attention exchanges keys and values itself (Transformer Engine, ``set_context_parallel_group``).
  Labels are cut the same way; a rank's loss is the mean over its tokens, and with equal token counts per
  rank the mean over the CP group is the loss of the whole sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


def head_tail_index(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions rank ``cp_rank`` of ``cp`` keeps: chunks cp_rank and 2cp-1-cp_rank of 2cp equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into 2 x {cp} equal chunks")
    chunk = seq_len // (2 * cp)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat([head, tail])


@dataclass
class StepContext:
    """Built by ``parallelize``; the loop runs each micro-batch's forward, loss and backward in ``step()``."""

    loss_parallel: bool = False
    cp_mesh: Any = None  # the "cp" mesh dimension, when context parallelism is on
    cp_mode: str = "none"  # "torch": torch's context_parallel; "split": we cut the batch (the model does the rest)
    cp_rotate: str = "allgather"  # torch CP: how keys/values travel ("allgather" or "alltoall")

    @contextlib.contextmanager
    def step(self, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> Iterator[tuple[dict, torch.Tensor]]:
        """Yields the model's keyword inputs and the labels as this rank must use them."""
        with contextlib.ExitStack() as stack:
            if self.loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            if self.cp_mode == "split":
                rank, cp = self.cp_mesh.get_local_rank(), self.cp_mesh.size()
                index = head_tail_index(labels.shape[1], cp, rank, labels.device)
                inputs = {k: v.index_select(1, index) for k, v in inputs.items()}
                labels = labels.index_select(1, index)
            elif self.cp_mode == "torch":
                inputs = {k: v.clone() for k, v in inputs.items()}  # sharded in place: never the caller's tensors
                labels = labels.clone()
                stack.enter_context(self._torch_context_parallel([*inputs.values(), labels]))
            yield inputs, labels

    def _torch_context_parallel(self, buffers: list[torch.Tensor]):
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method(self.cp_rotate)
        return context_parallel(self.cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers),
                                no_restore_buffers=set(buffers))
