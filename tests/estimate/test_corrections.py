"""The fake-mode corrections (estimate/corrections.py) rest on behaviours of transformers, torch and torchao. Each
test here shows the behaviour (the library takes another path on fake tensors than on real ones), and that the
correction puts the real path back. When a library changes, the first kind of assertion fails: its message says
whether the correction has become unnecessary (drop it) or its hook has moved (follow it)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from helpers import tiny_llama_config
from llama_fp8.estimate import corrections, fake


def _positions(batch: int, seq: int) -> torch.Tensor:
    """What the training step hands the Hugging Face model: ModelImpl.model_inputs' position ids."""
    from llama_fp8.models.hf import IMPL

    return IMPL.model_inputs(torch.zeros(batch, seq, dtype=torch.long))["position_ids"]


def test_transformers_sees_packing_in_fake_positions_only():
    from transformers import masking_utils

    assert masking_utils.find_packed_sequence_indices(_positions(2, 16)) is None, "real positions 0..T-1 are not packed"
    with FakeTensorMode():
        found = masking_utils.find_packed_sequence_indices(_positions(2, 16))
    assert found is not None, ("transformers no longer assumes packed sequences for fake position ids: "
                               "corrections.no_packed_sequences can go")
    with FakeTensorMode(), corrections.no_packed_sequences():
        assert masking_utils.find_packed_sequence_indices(_positions(2, 16)) is None


def _forward_peak(fake_run: bool, correct: bool) -> int:
    """Peak bytes the tracker sees in one forward of a tiny HF Llama (materialized like the estimate's)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=512, use_cache=False))  # as hf_config
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake_run else contextlib.nullcontext()
    with mode, corrections.no_packed_sequences() if correct else contextlib.nullcontext():
        model.to_empty(device="cpu")
        ids = torch.zeros(2, 512, dtype=torch.long)  # T x T masks outweigh the rest
        tracker = MemTracker()
        with tracker:
            model(input_ids=ids, position_ids=_positions(2, 512))
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_the_packed_mask_costs_memory_only_in_the_fake_run_and_the_correction_removes_it():
    real = _forward_peak(fake_run=False, correct=False)
    uncorrected = _forward_peak(fake_run=True, correct=False)
    assert uncorrected > real, ("transformers builds no packed-sequence mask under fake tensors any more (or the model "
                                "no longer calls find_packed_sequence_indices): corrections.no_packed_sequences "
                                "can go")
    assert _forward_peak(fake_run=True, correct=True) == real


def _dtensor_matmul_peak(out_features: int, fake_run: bool, correct: bool) -> int:
    """Peak bytes the tracker sees for one DTensor matmul (a column-sharded weight of ``out_features`` columns) on
    rank 0 of 2. DTensor caches propagation per op and shapes: each call here uses shapes of its own."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with fake.process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        mode = fake.tensor_mode() if fake_run else contextlib.nullcontext()
        fix = corrections.own_fake_mode_for_sharding_propagation() if correct else contextlib.nullcontext()
        with mode, fix:
            x = distribute_tensor(torch.empty(256, 512), mesh, [Replicate()])
            w = distribute_tensor(torch.empty(512, out_features), mesh, [Shard(1)])
            tracker = MemTracker()
            with tracker:
                x @ w
            return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_sharding_propagation_reuses_the_estimates_fake_mode_and_the_correction_gives_it_its_own():
    local_output = {n: 256 * (n // 2) * 4 for n in (1024, 2048, 4096)}  # a (256, n/2) FP32 shard: all it allocates
    assert _dtensor_matmul_peak(1024, fake_run=False, correct=False) == local_output[1024]
    uncorrected = _dtensor_matmul_peak(2048, fake_run=True, correct=False)
    assert uncorrected > local_output[2048], ("DTensor's sharding propagation no longer runs in the estimate's fake "
                                              "mode: corrections.own_fake_mode_for_sharding_propagation can go")
    assert _dtensor_matmul_peak(4096, fake_run=True, correct=True) == local_output[4096]


def test_torchao_asks_the_truth_value_of_its_scale_and_the_correction_answers_as_a_real_run():
    pytest.importorskip("torchao")
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    def weight():  # the scale computed by an op, as precompute_float8_dynamic_scale_for_fsdp does (not a constant)
        return WeightWithDynamicFloat8CastTensor(torch.ones(32, 32), LinearMMConfig(), torch.float8_e4m3fn,
                                                 torch.ones(32, 32).amax() * 448.0)

    assert weight().__tensor_flatten__()[0] == ["_tensor", "_precomputed_scale"]  # real: a positive scale is true
    with FakeTensorMode(allow_non_fake_inputs=True):
        w = weight()
        with pytest.raises(Exception) as raised:
            w.__tensor_flatten__()
    assert "DataDependent" in type(raised.value).__name__, (
        "torchao's WeightWithDynamicFloat8CastTensor.__tensor_flatten__ works on fake tensors now: "
        "corrections.torchao_scale_flatten can go")
    with FakeTensorMode(allow_non_fake_inputs=True), corrections.torchao_scale_flatten():
        assert weight().__tensor_flatten__()[0] == ["_tensor", "_precomputed_scale"]


def test_corrections_are_undone_on_exit():
    pytest.importorskip("torchao")
    from torch.distributed.tensor import _sharding_prop
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from transformers import masking_utils

    def now():
        return (masking_utils.find_packed_sequence_indices, _sharding_prop.detect_fake_mode,
                WeightWithDynamicFloat8CastTensor.__tensor_flatten__)

    before = now()
    with corrections.all_corrections():
        assert all(a is not b for a, b in zip(now(), before))  # each of the three replaced
    assert now() == before
    with pytest.raises(RuntimeError), corrections.all_corrections():  # also when the estimate fails inside
        raise RuntimeError("inside")
    assert now() == before
