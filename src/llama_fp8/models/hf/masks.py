"""Document masking for the Hugging Face model (``--doc_masking``): packed documents attend only within themselves.

The batch's position ids restart at 0 where a document starts (``data/doc_mask.py``), so a token's document is the
count of zeros up to it. A query attends to a key when the key is not later (causal) and in the same document: a
block-diagonal causal mask, handed to Hugging Face's attention as a ready 4D mask (transformers uses one as it is):

- SDPA: a boolean (B, 1, T, T) mask (True = attend). SDPA then runs its memory-efficient or math kernel (the flash
  kernel takes no mask); the mask is B T^2 bytes.
- FlexAttention: a ``BlockMask`` (``create_block_mask``), which skips whole blocks that lie outside every
  document: no dense mask, and attention FLOPs that fall with the documents' lengths. On CUDA it is the default
  (transformers compiles flex_attention); torch has no FlexAttention backward on CPU.

Context parallelism (torch's ``context_parallel``) runs SDPA causally without a mask on each rank's chunks, so it
cannot keep documents apart: ``--doc_masking`` with ``--cp_size > 1`` is refused for this model (``__init__``).
"""

from __future__ import annotations

import torch

SDPA, FLEX = "sdpa", "flex_attention"
ATTENTION = (SDPA, FLEX)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) index of each token's document in its row (a new one wherever a position is 0)."""
    return (position_ids == 0).cumsum(dim=1)


def sdpa_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query q may attend to key k (k <= q, same document)."""
    doc = document_ids(position_ids)
    t = position_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


def flex_mask(position_ids: torch.Tensor):
    """The same mask as a FlexAttention ``BlockMask`` (built by a compiled kernel on CUDA, in chunks elsewhere)."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = document_ids(position_ids)
    bsz, t = doc.shape

    def same_document_causal(b, h, q, k):
        return (k <= q) & (doc[b, q] == doc[b, k])

    return create_block_mask(same_document_causal, bsz, None, t, t, device=position_ids.device,
                             _compile=position_ids.device.type == "cuda")


def document_mask(position_ids: torch.Tensor, attention: str):
    """The 4D mask ``attention`` (the model's attention implementation) takes."""
    if attention == FLEX:
        return flex_mask(position_ids)
    if attention == SDPA:
        return sdpa_mask(position_ids)
    raise ValueError(f"--doc_masking: the Hugging Face model's attention {attention!r} takes no document mask here "
                     f"(supported: {', '.join(ATTENTION)})")
