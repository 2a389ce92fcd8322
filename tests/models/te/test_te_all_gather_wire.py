"""The all-gather byte meter of the FP8 all-gather GPU test (``gather_bytes``), checked on CPU: it must read
the bytes FSDP2 packs for the collective in the dtype it gathers them in (FP32, or BF16 under a BF16
mixed-precision policy), once FSDP2 has run (lazy init sets ``param_dtype``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_meter_reads_the_bytes_fsdp2_gathers_after_a_step(one_rank, gather_bytes, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16, bias=False))
    policy = MixedPrecisionPolicy(param_dtype=dtype)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    with pytest.raises(AttributeError, match="param_dtype"):  # before FSDP2's lazy init: the old test's crash
        gather_bytes(model[0])
    model(torch.randn(4, 32)).sum().backward()
    size = torch.tensor([], dtype=dtype).element_size()
    assert gather_bytes(model[0]) == (32 * 48 + 48) * size
    assert gather_bytes(model) == 48 * 16 * size
