"""Context parallelism for the TE Llama: Transformer Engine's own (``set_context_parallel_group``).

Each rank receives its head-tail chunks of the sequence (cut by ``parallel/context.py``: chunks r and
2cp-1-r, TE's DUAL_CHUNK_SWAP layout, as TE's own test
TransformerEngine/tests/pytorch/attention/run_attention_with_cp.py cuts bshd batches) and TE's attention exchanges keys and values over the CP group: a ring of P2P transfers
("p2p"), an all-gather ("all_gather"), all-to-alls over heads ("a2a", DeepSpeed-Ulysses style), or a2a
within pairs of CP ranks and p2p between the pairs ("a2a+p2p", the two-level split TE's test uses). The
RoPE angles are passed for the whole sequence: TE's fused RoPE picks each rank's positions from its CP
rank and size. Tensor parallelism is not offered: TE's TP keeps plain per-rank weight shards that FSDP2's
DTensor checkpoints would not tell apart (TE's DTensor support, NVIDIA/TransformerEngine#2713, is unreleased).
"""

from __future__ import annotations

import torch
from torch import nn


def a2a_p2p_ranks(cp_ranks: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(a2a groups, p2p groups) of a CP group for "a2a+p2p": pairs of neighbours, and the ranks at the same
    position of every pair."""
    pairs = [cp_ranks[i:i + 2] for i in range(0, len(cp_ranks), 2)]
    return pairs, [cp_ranks[j::2] for j in range(2)]


def cp_groups(cp_mesh, comm_type: str, all_cp_ranks: list[list[int]]):
    """The group argument of ``set_context_parallel_group`` for this rank, and its CP group's global ranks.
    ``all_cp_ranks``: every CP group of the world (``ParallelDims.groups("cp")``): creating process groups
    is collective, so every rank creates every sub-group, in the same order."""
    import torch.distributed as dist

    group = cp_mesh.get_group()
    ranks = dist.get_process_group_ranks(group)
    if comm_type != "a2a+p2p":
        return group, ranks
    me, mine = dist.get_rank(), []
    for cp_ranks in all_cp_ranks:
        pairs, rings = a2a_p2p_ranks(cp_ranks)
        for sub in (*pairs, *rings):
            g = dist.new_group(sub)
            if me in sub:
                mine.append(g)
    return mine, ranks  # [a2a group, p2p group], the order TE expects


def set_context_parallel(model: nn.Module, cp_mesh, comm_type: str, all_cp_ranks: list[list[int]],
                         stream=None) -> int:
    """Give every TE TransformerLayer the CP group; returns how many layers were set."""
    group, ranks = cp_groups(cp_mesh, comm_type, all_cp_ranks)
    stream = stream if stream is not None else torch.cuda.Stream()
    count = 0
    for layer in model.model.layers:
        te_layer = getattr(layer, "te_layer", None) or layer._checkpoint_wrapped_module.te_layer
        te_layer.set_context_parallel_group(group, ranks, stream, comm_type)
        count += 1
    model.model.cp_size = cp_mesh.size()  # RoPE angles for the whole sequence (TE picks this rank's)
    return count
