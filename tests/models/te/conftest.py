"""Fixtures of the TE tests."""

from __future__ import annotations

import pytest
from torch import nn


def all_gather_bytes(module: nn.Module) -> int:
    """Bytes one all-gather of ``module``'s FSDP2 parameter group sends from this rank: the tensors FSDP2's own
    copy-in (``_get_param_all_gather_inputs``, what ``foreach_all_gather`` packs into the collective's buffer)
    produces now, through each parameter's ``fsdp_pre_all_gather`` where it has one (TE's FP8 weights: their
    FP8 data). Read it after a step: before FSDP2's lazy init ``param_dtype`` is unset and the Parameters TE's
    ``reset_parameters`` swapped in are not yet the ones FSDP2 gathers. (On one rank FSDP2 skips the collective
    itself; the bytes it would send are the same.)"""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_param_all_gather_inputs

    group = module._get_fsdp_state()._fsdp_param_group
    inputs = _get_param_all_gather_inputs(group.fsdp_params)
    return sum(t.numel() * t.element_size() for ts in inputs for t in ts)


@pytest.fixture
def gather_bytes():
    return all_gather_bytes
