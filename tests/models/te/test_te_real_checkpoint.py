"""TE FP8 scaling state through our checkpoints, with real Transformer Engine modules on CPU (make test-te).

DelayedScaling keeps per-tensor scales and an amax history in each TE module; TE serializes them as a
pickle of variable size in ``_extra_state``. Here they are set as TE sets them after FP8 steps
(``RecipeState`` objects in ``fp8_meta``, allocated on CPU because TE's own initializer allocates on CUDA),
and TE's real ``get_extra_state`` pickles them (its ``torch.cuda.synchronize`` is a no-op here). What is
checked: TE's pickle breaks a plain DCP resume (NVIDIA/TransformerEngine#1860); through our hooks the
state resumes exactly, as plain tensors, with no pickle in the checkpoint; a pickle planted in a checkpoint
is never unpickled."""

from __future__ import annotations

import pickle
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import transformer_engine.pytorch as te  # noqa: F401  (torch first: TE finds libnccl through torch)
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling
from transformer_engine.pytorch.quantization import RecipeState

from helpers import build_te_sharded
from llama_fp8 import checkpoint, data
from llama_fp8 import config as C
from llama_fp8.models.te.fp8 import state as fp8_state

pytestmark = pytest.mark.te
ARGS = ["--model", "tiny", "--num_layers", "2", "--device", "cpu", "--model_impl", "te"]


@pytest.fixture
def env(one_rank):
    return one_rank


def set_fp8_state(model, recipe, seed: int | None) -> None:
    """What TE's first FP8 forward leaves in every TE module (on CPU), filled with values from ``seed``
    (None: TE's initial ones, scale 1 and a zero history)."""
    gen = torch.Generator().manual_seed(seed or 0)
    for _, m in fp8_state.te_modules(model):
        n = fp8_state.num_gemms(m)
        m.fp8_meta.update(recipe=recipe, num_gemms=n, fp8_checkpoint=seed is not None)
        for key, mode, count in (("scaling_fwd", "forward", 3 * n), ("scaling_bwd", "backward", 2 * n)):
            m.fp8_meta[key] = RecipeState.create(recipe, mode=mode, num_quantizers=count, device=torch.device("cpu"))
            if seed is not None and hasattr(m.fp8_meta[key], "amax_history"):
                m.fp8_meta[key].scale.copy_(torch.rand(count, generator=gen) + 0.5)
                m.fp8_meta[key].amax_history.copy_(torch.rand(m.fp8_meta[key].amax_history.shape, generator=gen))


def scaling(model, clone: bool = True) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}.{what}": getattr(m.fp8_meta[key], what).clone() if clone else getattr(m.fp8_meta[key], what)
            for name, m in fp8_state.te_modules(model) for key in ("scaling_fwd", "scaling_bwd")
            for what in ("scale", "amax_history")}


def save_and_resume(env, tmp_path, saver, fresh, cfg) -> int:
    """Through our Checkpointer: save ``saver`` at step 3, load into ``fresh``; returns the loaded step."""
    def parts(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        return opt, sched, data.build_train_loader(cfg, 0, 1)

    ckpt = checkpoint.Checkpointer(tmp_path / "ckpt", 2, False, env.rank, env.world_size)
    with mock.patch.object(torch.cuda, "synchronize"):  # inside TE's get_extra_state
        ckpt.save(3, saver, *parts(saver), cfg, None)
    return ckpt.load(tmp_path / "ckpt" / "step_3", fresh, *parts(fresh), cfg.train_batch_size)


def test_te_pickled_scaling_state_breaks_a_plain_dcp_resume(env, tmp_path):
    """The bug this file is about, reproduced: without our hooks the resume fails in DCP."""
    cfg = C.parse_args(ARGS)
    saver, fresh = build_te_sharded(cfg, env), build_te_sharded(cfg, env)
    set_fp8_state(saver, DelayedScaling(amax_history_len=16), seed=1)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    with pytest.raises((CheckpointException, C.ConfigError)) as e:  # DCP's error, or the checkpointer's report
        save_and_resume(env, tmp_path, saver, fresh, cfg)
    text = str(e.value)
    assert re.search(r"Size mismatch between saved torch.Size\(\[\d+\]\) and current: torch.Size\(\[0\]\) for "
                     r"model\.model\.layers\.0\.te_layer\..*\._extra_state", text) or re.search(
        r"model\.model\.layers\.0\.te_layer\.\S*\._extra_state saved \(\d+,\), this run \(0,\)", text), text[-500:]


def test_delayed_scaling_state_resumes_exactly_with_no_pickle(env, tmp_path):
    cfg = C.parse_args(ARGS)
    recipe = DelayedScaling(amax_history_len=16)
    saver, fresh = build_te_sharded(cfg, env), build_te_sharded(cfg, env)
    set_fp8_state(saver, recipe, seed=1)
    set_fp8_state(fresh, recipe, seed=None)
    for model in (saver, fresh):  # what TEFp8.prepare does after its GPU-only allocation
        fp8_state.keep_pickles_out(model)
        assert fp8_state.expose_scaling_state(model) == 4 * 4 * 2  # 4 TE modules x 2 layers, 4 tensors each
    want = scaling(saver)
    assert not any(torch.equal(want[k], v) for k, v in scaling(fresh).items())
    views = {k: v.data_ptr() for k, v in scaling(fresh, clone=False).items()}
    assert save_and_resume(env, tmp_path, saver, fresh, cfg) == 3
    got = scaling(fresh)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # Restored in place: TE's quantizers and global amax buffers keep pointing at the same storage.
    assert {k: v.data_ptr() for k, v in scaling(fresh, clone=False).items()} == views
    meta = dist.checkpoint.FileSystemReader(str(tmp_path / "ckpt" / "step_3")).read_metadata()
    extra = {k: v.size for k, v in meta.state_dict_metadata.items() if k.endswith("_extra_state")}
    assert extra and all(size == torch.Size([0]) for size in extra.values())  # no pickle written
    assert sum(k.endswith("fp8_amax_history_fwd") for k in meta.state_dict_metadata) == 8


def test_stateless_recipe_saves_no_scaling_state(env, tmp_path):
    cfg = C.parse_args(ARGS)
    saver, fresh = build_te_sharded(cfg, env), build_te_sharded(cfg, env)
    for model, seed in ((saver, 1), (fresh, None)):
        set_fp8_state(model, Float8CurrentScaling(), seed=seed)
        fp8_state.keep_pickles_out(model)
        assert fp8_state.expose_scaling_state(model) == 0  # current scaling: nothing to carry
    assert save_and_resume(env, tmp_path, saver, fresh, cfg) == 3


class Planted:
    ran = False

    def __reduce__(self):
        return (setattr, (Planted, "ran", True))


def test_a_pickle_planted_in_extra_state_is_never_unpickled(env, monkeypatch):
    """Even with TE's opt-in to unsafe pickles set, a payload in a checkpoint's _extra_state never runs."""
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    model = build_te_sharded(C.parse_args(ARGS), env)
    fp8_state.keep_pickles_out(model)
    state = model.state_dict()
    payload = torch.frombuffer(bytearray(pickle.dumps({"recipe": Planted()})), dtype=torch.uint8)
    for key in [k for k in state if k.endswith("_extra_state")]:
        state[key] = payload
    model.load_state_dict(state)
    assert Planted.ran is False


def test_a_pickle_planted_for_fp8_weight_modules_is_never_unpickled(env, monkeypatch):
    """TE modules with FP8 primary weights (``primary_weights_in_fp8``: TE's own _load_from_state_dict then hands
    the checkpoint's _extra_state to set_extra_state before any pre-hook of the module runs), loaded through the
    model's root as the checkpointer does, with TE's opt-in to unsafe pickles set: the payload never runs. (The
    modules' weights stay plain here: only the load path of FP8-weight modules is exercised.)"""
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    model = build_te_sharded(C.parse_args(ARGS), env)
    modules = [m for _, m in fp8_state.te_modules(model) if hasattr(m, "primary_weights_in_fp8")]
    assert modules
    for m in modules:
        m.primary_weights_in_fp8 = True
    fp8_state.keep_pickles_out(model)
    state = model.state_dict()
    payload = torch.frombuffer(bytearray(pickle.dumps({"recipe": Planted()})), dtype=torch.uint8)
    for key in [k for k in state if k.endswith("_extra_state")]:
        state[key] = payload
    model.load_state_dict(state)
    assert Planted.ran is False
