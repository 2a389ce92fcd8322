"""Where fake tensors make a library take another path than it takes on real tensors, put the real path back.

Each correction is a context manager that changes one library function for the duration of an estimate, and
each rests on a behaviour of the installed library that tests/estimate/test_corrections.py checks: when the
library changes, that test fails and says whether the correction is still needed. Without them the fake run
allocates tensors the real run never has (found by comparing the two byte for byte,
tests/estimate/test_equality.py).

1. transformers' packed-sequence detection. ``masking_utils.find_packed_sequence_indices(position_ids)`` decides
   whether a batch holds several documents per row (positions restarting inside a row) and then builds a
   B x 1 x T x T attention mask. It looks at the values, except when ``is_tracing`` says the tensor is being
   traced, which includes any fake tensor: then it assumes packing. Our model inputs never restart positions
   (``ModelImpl.model_inputs`` gives 0..T-1 in every row), so on real tensors it returns None and SDPA runs
   causal without a mask; here it returns None too. (Without it: +256 KiB on the tests' 2 x 128-token peak, and
   under tensor parallelism the fake step fails on the mask's shape.)
2. DTensor's sharding propagation. To learn an op's output shape, ``ShardingPropagator`` runs the op on fake
   tensors of the *global* shape, in ``detect_fake_mode() or FakeTensorMode()``. In a real run there is no fake
   mode, so it makes its own, and the estimate's tracker (tracker.py, as torch 2.13's FSDPMemTracker) skips ops
   that run in a mode other than the one it was entered in. Under an estimate ``detect_fake_mode()`` finds the
   estimate's own mode, and the tracker counts those global-size tensors as if allocated (+10 % on the peak of tests/estimate/test_equality.py's TP=2 case). Here
   propagation gets its own mode, as in the real run.
3. torchao's FP8 weight wrapper. ``WeightWithDynamicFloat8CastTensor.__tensor_flatten__`` tests
   ``if self._precomputed_scale:`` (the truth value of a one-element tensor), which fake tensors cannot answer.
   The scale is a positive number on real tensors (amax clamped away from zero), so the real answer is "the scale
   is there" exactly when it is not None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def _replaced(owner, name: str, value) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def no_packed_sequences():
    """1: ``find_packed_sequence_indices`` answers as it does for our (never packed) positions on real tensors."""
    from transformers import masking_utils

    def find_packed_sequence_indices(position_ids):  # our positions are 0..T-1 in every row: nothing is packed
        return None

    return _replaced(masking_utils, "find_packed_sequence_indices", find_packed_sequence_indices)


def own_fake_mode_for_sharding_propagation():
    """2: DTensor's shape propagation runs in a fake mode of its own, never the estimate's."""
    from torch.distributed.tensor import _sharding_prop

    def detect_fake_mode(*args, **kwargs):  # as in a real run: no fake mode around, so propagation makes its own
        return None

    return _replaced(_sharding_prop, "detect_fake_mode", detect_fake_mode)


def torchao_scale_flatten():
    """3: torchao's FP8 weight wrapper flattens its precomputed scale when it has one (``is not None``)."""
    try:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    except ImportError:  # no torchao: nothing to correct (FP8 runs are refused earlier)
        return contextlib.nullcontext()

    def __tensor_flatten__(self):
        inner = ["_tensor"] + (["_precomputed_scale"] if self._precomputed_scale is not None else [])
        return inner, {"mm_config": self._linear_mm_config, "dtype": self._dtype}

    return _replaced(WeightWithDynamicFloat8CastTensor, "__tensor_flatten__", __tensor_flatten__)


@contextlib.contextmanager
def all_corrections() -> Iterator[None]:
    with no_packed_sequences(), own_fake_mode_for_sharding_propagation(), torchao_scale_flatten():
        yield


NAMES = ("transformers packed-sequence detection (no mask for positions 0..T-1)",
         "DTensor sharding propagation in its own fake mode",
         "torchao FP8 weight scale flattened when present")
