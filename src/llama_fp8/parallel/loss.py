"""The training loss: the output projection and the cross entropy, a chunk of tokens at a time, so that the logits
(tokens x vocabulary, upcast to FP32 for the softmax) never exist whole.

``cross_entropy`` is the definition: the mean next-token cross entropy of FP32 logits, labels already aligned with
them, -100 ignored. Computed that way from the whole (B, T, V) logits, a step holds them in BF16, their FP32 copy,
the log-softmax autograd saves and, in backward, FP32 gradients of the same size: for Llama 3.1 8B at 2 x 8192
tokens per GPU 3.9 + 7.8 + 7.8 + 15.7 GiB, the largest part of the step's peak.

``output_cross_entropy`` computes the same loss from the final hidden states and the output projection's weight:
for each chunk of rows it forms the chunk's logits, their log-sum-exp, the loss and, at once, the gradients
(softmax minus one-hot, over the valid tokens' count), and multiplies them out into the gradients of the hidden
states and of the weight; the chunk's logits are then dropped. Forward thus does the work of backward too (as
Liger-Kernel's fused linear cross entropy does: no logits are recomputed) and backward only scales the saved
gradients by the incoming one. What it keeps is the gradient of the hidden states (tokens x hidden, their dtype) and
of the weight, accumulated over the chunks in FP32 (vocabulary x hidden x 4 bytes; returned in the weight's dtype).

It equals ``cross_entropy`` of the whole logits within the tolerance stated in tests/parallel/test_loss.py: the
same numbers per row, the weight's gradient summed over the chunks (FP32: 1e-5; BF16: of the order of one BF16
rounding, 1e-2).

Tensor parallelism (loss parallelism): the weight is a DTensor sharded over the vocabulary on the tensor-parallel
mesh, each rank forms its vocabulary slice of the logits, and the chunk's per-row log-sum-exp and target logit are
combined over the group (two all-reduces of a few floats per row). The hidden states, sequence-sharded after the
final norm, are gathered first (their gradient is reduce-scattered back), as the LM head's own ``ColwiseParallel``
input does. Context parallelism: every rank holds its tokens of each sequence and computes the mean over them, as
before.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

IGNORE_INDEX = -100
CHUNK_BYTES = 256 * 2**20
"""The FP32 logits of one chunk at most (the transient of a chunk is about 2.5 times this): 512 tokens of a
128,256-token vocabulary; a GEMM of 512 rows keeps an H100 compute-bound."""


class OutputHead(nn.Linear):
    """The LM head: a bias-free ``nn.Linear`` whose forward, given ``targets``, returns the training loss of its input
    instead of the logits. ``parallelize`` makes it an FSDP2 unit of its own: its weight is all-gathered for the
    loss, and its gradient reduce-scattered as soon as the loss's backward has run, not at the end of backward."""

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (B, T, H) -> logits (B, T, V); with targets (B, T), aligned with hidden (-100 ignored): their mean
        cross entropy (a keyword: a tensor-parallel style passes the first input only)."""
        if targets is None:
            return super().forward(hidden)
        return output_cross_entropy(hidden, self.weight, targets)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of (B, T, V) logits in FP32 against (B, T) labels, -100 ignored (under ``loss_parallel``
    the logits may be a DTensor sharded over the vocabulary). The reference ``output_cross_entropy`` equals."""
    return functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def chunk_rows(vocab_local: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: FP32 logits of at most ``chunk_bytes``, a multiple of 128 rows from 128 rows up."""
    rows = chunk_bytes // (4 * vocab_local)
    return max(128, rows - rows % 128)


def output_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         rows: int | None = None) -> torch.Tensor:
    """``cross_entropy(functional.linear(hidden, weight), labels)`` without the whole logits: hidden (B, T, H) (a
    DTensor under tensor parallelism, sharded or not), weight (V, H) (a DTensor sharded over V under tensor
    parallelism), labels (B, T). ``rows``: tokens per chunk (default ``chunk_rows``)."""
    hidden, weight, group, vocab_start = _local(hidden, weight)
    hidden, labels = hidden.flatten(0, 1), labels.flatten().to(hidden.device)
    rows = rows or chunk_rows(weight.shape[0])
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        with torch.no_grad():
            return _chunks(hidden, weight, labels, group, vocab_start, rows, grads=False)[0]
    return _LossAndGradients.apply(hidden, weight, labels, group, vocab_start, rows)


def _local(hidden: torch.Tensor, weight: torch.Tensor):
    """(hidden, weight) as plain tensors with autograd kept, the tensor-parallel group (None without) and the first
    vocabulary row of this rank's slice of the weight."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if not isinstance(weight, DTensor):
        assert not isinstance(hidden, DTensor), "hidden states are a DTensor but the output weight is not"
        return hidden, weight, None, 0
    mesh = weight.device_mesh
    assert mesh.ndim == 1 and weight.placements[0].is_shard(0), f"output weight placements {weight.placements}"
    if not isinstance(hidden, DTensor):  # the same on every rank of the group (backward: all-reduce)
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    # Sequence-sharded after the final norm: gathered (backward: reduce-scatter). Each rank's gradient of the
    # gathered hidden states is its vocabulary slice's part of the sum: Partial.
    hidden = hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    rank, size = mesh.get_local_rank(), mesh.size()
    per_rank = -(-weight.shape[0] // size)  # torch.chunk's split, as Shard(0) places the rows
    return hidden, weight.to_local(), mesh.get_group(), rank * per_rank


class _LossAndGradients(torch.autograd.Function):
    """Forward returns the loss and saves its gradients; backward scales them (see the module's docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, group, vocab_start, rows):
        loss, grad_hidden, grad_weight = _chunks(hidden, weight, labels, group, vocab_start, rows, grads=True)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        dtype = ctx.weight_dtype
        # Scaled in FP32 before the weight's gradient is rounded to its dtype, as one matmul of the whole would be.
        grad_weight = grad_weight.mul_(grad_loss).to(dtype)
        grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunks(hidden, weight, labels, group, vocab_start: int, rows: int, grads: bool):
    """The loss (and with ``grads`` the gradients of hidden and weight) over chunks of ``rows`` tokens."""
    valid = labels != IGNORE_INDEX
    count = valid.sum()  # the mean's denominator: every valid token of this rank, as in cross_entropy
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if grads else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if grads else None
    for start in range(0, hidden.shape[0], rows):
        h, y, ok = hidden[start:start + rows], labels[start:start + rows], valid[start:start + rows]
        logits = functional.linear(h, weight).float()  # (rows, V / tp): the projection in the weight's dtype
        local = y - vocab_start
        mine = (local >= 0) & (local < weight.shape[0])  # this rank's slice of the vocabulary holds the target
        index = (local * mine).unsqueeze(1)  # (rows, 1); 0 where another rank holds it (masked below)
        target = logits.gather(1, index).squeeze(1) * mine
        lse = torch.logsumexp(logits, dim=1)
        if group is not None:
            lse, target = _combine(lse, target, group)
        loss += ((lse - target) * ok).sum()
        if grads:
            # d loss / d logits = (softmax - one-hot) / count on valid rows: in place on the FP32 logits.
            probs = logits.sub_(lse.unsqueeze(1)).exp_()
            probs.scatter_add_(1, index, -mine.unsqueeze(1).to(probs.dtype))
            probs.mul_((ok / count).unsqueeze(1))
            g = probs.to(weight.dtype)
            del logits, probs
            grad_hidden[start:start + rows] = g @ weight
            grad_weight += g.t() @ h
    return loss / count, grad_hidden, grad_weight


def _combine(lse: torch.Tensor, target: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Over the tensor-parallel group: the log-sum-exp of the ranks' log-sum-exps (shifted by their maximum), the sum
    of the target logits (only the rank that holds a row's target has it). Two all-reduces, in place."""
    import torch.distributed as dist

    top = lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([(lse - top).exp_(), target])  # (2, rows)
    dist.all_reduce(sums, group=group)
    return top + sums[0].log(), sums[1]
