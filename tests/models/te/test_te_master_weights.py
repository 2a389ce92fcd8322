"""FP8 primary weights (``--fp8_all_gather 1``, TE) are optimized through FP32 master weights, on CPU.

Transformer Engine cannot run here, so its FP8 parameter is emulated by ``EmulatedFp8``: a parameter whose
values are always E4M3 with per-tensor current scaling (amax -> 448), with the two methods of TE's
QuantizedTensor the optimizer uses (``dequantize(dtype=)``, ``quantize_(src)``). Its nominal dtype is BF16,
as a TE FP8 weight reports the dtype it was built in, so a checkpoint load that casts to it is visible."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from llama_fp8.models.te.fp8.master_weights import MasterAdamW, is_quantized
from llama_fp8.models.te.fp8.precision import TEFp8
from llama_fp8.precision import Plain
from llama_fp8.train import build


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """E4M3 with per-tensor current scaling, dequantized to FP32."""
    scale = 448.0 / x.abs().max().clamp(min=1e-12)
    return (x.float() * scale).to(torch.float8_e4m3fn).float() / scale


class EmulatedFp8(nn.Parameter):
    def quantize_(self, src: torch.Tensor):
        self.data.copy_(e4m3(src))
        return self

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self.data.to(dtype)


class Fp8Linear(nn.Module):
    def __init__(self, rows: int = 64, cols: int = 64, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(rows, cols, generator=g) * 0.02
        self.weight = EmulatedFp8(e4m3(w).to(torch.bfloat16))
        self.norm = nn.Parameter(torch.ones(cols))


CFG = types.SimpleNamespace(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.0, optimizer="adamw")
CPU = torch.device("cpu")


def fp8_optimizer(model, cfg=CFG):
    return build.build_optimizer(model, cfg, CPU, TEFp8(None, all_gather=True, stateful=False))


def set_grads(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def test_fp8_weights_get_fp32_masters_and_one_step_moves_the_master_by_exactly_adamw():
    model = Fp8Linear()
    opt = fp8_optimizer(model)
    assert isinstance(opt, MasterAdamW)
    # The same step by torch's AdamW on an FP32 copy: what the master must become, to the bit.
    ref_w = nn.Parameter(model.weight.dequantize(torch.float32).clone())
    ref_n = nn.Parameter(model.norm.detach().clone())
    ref = torch.optim.AdamW([ref_w, ref_n], lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=1e-8, weight_decay=0.0)
    set_grads(model, 1)
    ref_w.grad, ref_n.grad = model.weight.grad.float(), model.norm.grad.clone()
    before = model.weight.dequantize(torch.float32).clone()
    opt.step()
    ref.step()
    state = opt.state[model.weight]
    assert state["master"].dtype == state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert state["master"].shape == model.weight.shape
    assert "master" not in opt.state[model.norm]  # a BF16/FP32 parameter is its own master
    assert torch.equal(state["master"], ref_w.detach())
    assert torch.equal(model.norm.detach(), ref_n.detach())
    moved = (state["master"] - before).abs()
    assert torch.allclose(moved, torch.full_like(moved, CFG.lr), rtol=1e-3)  # Adam's first step: lr per value
    # The FP8 weight is re-quantized from the master: most tiny updates do not show in it, but are kept.
    assert torch.equal(model.weight.dequantize(torch.float32), e4m3(state["master"]).bfloat16().float())
    assert (model.weight.dequantize(torch.float32) == before).float().mean() > 0.5


def test_bf16_weights_and_plain_precision_keep_the_configured_optimizer():
    model = Fp8Linear()
    for prec in (Plain(), TEFp8(None, all_gather=False, stateful=False), None):
        opt = build.build_optimizer(model, CFG, CPU, prec)
        assert type(opt) is torch.optim.AdamW


def _train(model, opt, steps: int, lr: float, requantize_param: bool = False) -> None:
    for _ in range(steps):
        model.weight.grad = torch.ones(model.weight.shape, dtype=model.weight.dtype)  # one consistent direction
        model.norm.grad = torch.zeros_like(model.norm)
        opt.step()
        if requantize_param:  # what TE's FP8 tensor does to an in-place update of its dequantized value
            model.weight.quantize_(model.weight.detach())


@pytest.mark.parametrize("lr", [1e-4, 3e-4])
def test_small_updates_accumulate_through_the_master_where_plain_adamw_loses_them(lr):
    """100 steps in one direction: Adam moves each value by lr per step. With FP32 masters the FP8 weight lands
    the whole update (up to FP8 rounding of the final value); AdamW on the FP8 weight itself (the old path)
    rounds most of every step away."""
    steps, intended = 100, 100 * lr
    cfg = types.SimpleNamespace(**{**vars(CFG), "lr": lr})
    ours, old = Fp8Linear(), Fp8Linear()
    start = ours.weight.dequantize(torch.float32).clone()
    opt = fp8_optimizer(ours, cfg)
    _train(ours, opt, steps, lr)
    plain = torch.optim.AdamW(old.parameters(), lr=lr, betas=(CFG.beta1, CFG.beta2), eps=1e-8, weight_decay=0.0)
    _train(old, plain, steps, lr, requantize_param=True)
    master_moved = (start - opt.state[ours.weight]["master"]).mean().item()
    landed_ours = (start - ours.weight.dequantize(torch.float32)).mean().item() / intended
    landed_old = (start - old.weight.dequantize(torch.float32)).mean().item() / intended
    assert master_moved == pytest.approx(intended, rel=1e-3)
    assert 0.9 < landed_ours < 1.1, landed_ours
    assert landed_old < 0.5, landed_old


def test_masters_survive_a_state_dict_round_trip_in_fp32():
    """Save after 5 steps, load into a fresh model + optimizer, 5 more steps: identical to 10 uninterrupted steps
    (torch's loader would cast the masters to the FP8 weight's nominal BF16; they must come back FP32)."""
    straight = Fp8Linear()
    opt = fp8_optimizer(straight)
    for s in range(5):
        set_grads(straight, s)
        opt.step()
    saved_model, saved_opt = copy.deepcopy(straight.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["state"][0]["master"].dtype == torch.float32
    resumed = Fp8Linear(seed=7)
    resumed.load_state_dict(saved_model)
    opt2 = fp8_optimizer(resumed)
    opt2.load_state_dict(saved_opt)
    assert opt2.state[resumed.weight]["master"].dtype == torch.float32
    assert torch.equal(opt2.state[resumed.weight]["master"], opt.state[straight.weight]["master"])
    for s in range(5, 10):
        for m, o in ((straight, opt), (resumed, opt2)):
            set_grads(m, s)
            o.step()
    assert torch.equal(opt2.state[resumed.weight]["master"], opt.state[straight.weight]["master"])
    assert torch.equal(resumed.weight.detach(), straight.weight.detach())


def test_distributed_checkpoint_state_dict_names_the_master_by_parameter():
    """What the checkpointer saves (torch.distributed.checkpoint's get_state_dict): the master under the FP8
    weight's own name, in FP32; set_state_dict restores it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = Fp8Linear()
    opt = fp8_optimizer(model)
    set_grads(model, 0)
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    master = optim_sd["state"]["weight"]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, opt.state[model.weight]["master"])
    other = Fp8Linear(seed=3)
    opt2 = fp8_optimizer(other)
    set_state_dict(other, opt2, model_state_dict=copy.deepcopy(model_sd), optim_state_dict=copy.deepcopy(optim_sd))
    assert opt2.state[other.weight]["master"].dtype == torch.float32
    assert torch.equal(opt2.state[other.weight]["master"], master)


def test_only_quantized_parameters_count_as_fp8():
    model = Fp8Linear()
    assert is_quantized(model.weight) and not is_quantized(model.norm)


def test_low_bit_optimizers_are_refused_with_fp8_weights(monkeypatch):
    """torchao's 8-bit/FP8 AdamW keep no FP32 masters: with FP8 primary weights they are refused before any
    model is built (a pretended Hopper with TE 2.20)."""
    from llama_fp8 import config as C
    from llama_fp8 import models
    from llama_fp8 import precision as P
    from llama_fp8.models.te.fp8 import recipes as te_recipes

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(te_recipes, "te_import", lambda: object())
    monkeypatch.setattr(te_recipes, "te_version", lambda: "2.20.2")
    cuda, te = torch.device("cuda", 0), models.get("te")
    args = ["--model", "tiny", "--fp8", "1", "--fp8_all_gather", "1"]
    assert P.resolve(C.parse_args([*args, "--optimizer", "adamw"]), te, cuda).all_gather is True
    for low in ("adamw8bit", "adamw_fp8"):
        with pytest.raises(C.ConfigError, match=f"--optimizer {low} with --fp8_all_gather 1 .*use --optimizer adamw"):
            P.resolve(C.parse_args([*args, "--optimizer", low]), te, cuda)


def test_on_fsdp2_shards_it_steps_like_torch_adamw(one_rank):
    """Sharded (DTensor) parameters: the same update as torch.optim.AdamW, states sharded like the parameters."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for m in models:
        fully_shard(m)
    ours = MasterAdamW(models[0].parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(models[1].parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randn(8, 16)
    for _ in range(3):
        for m, opt in zip(models, (ours, ref)):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert isinstance(a, DTensor) and torch.equal(a.full_tensor(), b.full_tensor())
    assert all(isinstance(s["exp_avg"], DTensor) for s in ours.state.values())


def test_a_state_without_masters_gets_them_at_the_next_step():
    """Moments from torch's AdamW (no master): the FP8 weight still steps through an FP32 master, never in FP8."""
    model = Fp8Linear()
    plain = build.build_optimizer(model, CFG, CPU, Plain())  # torch's AdamW, the same groups
    set_grads(model, 0)
    plain.step()
    model.weight.quantize_(model.weight.detach())
    opt = fp8_optimizer(model)
    opt.load_state_dict(plain.state_dict())
    assert "master" not in opt.state[model.weight]
    set_grads(model, 1)
    opt.step()
    state = opt.state[model.weight]
    assert state["master"].dtype == state["exp_avg"].dtype == torch.float32 and float(state["step"]) == 2
    assert torch.equal(model.weight.dequantize(torch.float32), e4m3(state["master"]).bfloat16().float())


class QuantizedInitLinear(nn.Module):
    """A TE-like FP8-weight module (``primary_weights_in_fp8``): its ``reset_parameters`` runs the parameter's
    ``init_fn`` on a high-precision tensor and then keeps only the quantized values, as TE's does
    (module/base.py: init_fn, then ``quantizer(param)``), here as an ``EmulatedFp8`` parameter."""

    primary_weights_in_fp8 = True

    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, device="meta"))
        self.param_init_meta = {"weight": types.SimpleNamespace(init_fn=None)}

    def reset_parameters(self):
        values = torch.empty(self.weight.shape)
        self.param_init_meta["weight"].init_fn(values)
        self.weight = EmulatedFp8(e4m3(values).to(torch.bfloat16))


def test_the_first_master_is_the_bf16_partners_initial_weight_not_its_fp8_quantization():
    """FP8 primary weights start from the FP8-quantized init; their FP32 masters must start from the init the BF16
    partner gets (our sharding-independent init), else the FP8-weight run starts from other weights."""
    from llama_fp8.models import common
    from llama_fp8.models.te.fp8 import params as fp8_params

    cfg = types.SimpleNamespace(**vars(CFG), initializer_range=0.02, seed=5)
    fp8 = nn.Module()
    fp8.proj = QuantizedInitLinear(64, 32)
    fp8_params.materialize(fp8, CPU, cfg)
    partner = torch.empty(64, 32)
    common.init_part_(partner, (0, 0), (64, 32), "proj.weight", cfg)  # what the BF16 run's weight starts from
    assert not torch.equal(fp8.proj.weight.dequantize(), partner)  # the FP8 weight is the coarse version
    opt = build.build_optimizer(fp8, types.SimpleNamespace(**{**vars(cfg), "lr": 0.0}), CPU,
                                TEFp8(None, all_gather=True, stateful=False))
    fp8.proj.weight.grad = torch.zeros(64, 32, dtype=torch.bfloat16)
    opt.step()  # lr 0, no weight decay: the master stays what it was created as
    assert torch.equal(opt.state[fp8.proj.weight]["master"], partner)


def test_fused_master_adamw_steps_exactly_like_torchs_fused_adamw():
    """Every other run's optimizer is torch's fused AdamW on CUDA: the FP8-weight runs get the same fused kernel
    (on CPU here: torch has a fused CPU AdamW), for the masters and the other parameters alike, or their step
    times would differ by the optimizer, not by FP8."""
    fp8 = Fp8Linear()
    ref_w = nn.Parameter(fp8.weight.dequantize(torch.float32).clone())
    ref_n = nn.Parameter(fp8.norm.detach().clone())
    ours = MasterAdamW(fp8.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    ref = torch.optim.AdamW([ref_w, ref_n], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    assert ours.param_groups[0]["fused"] is True
    for s in range(3):
        set_grads(fp8, s)
        ref_w.grad, ref_n.grad = fp8.weight.grad.float(), fp8.norm.grad.clone()
        ours.step()
        ref.step()
    assert torch.equal(ours.state[fp8.weight]["master"], ref_w.detach())
    assert torch.equal(fp8.norm.detach(), ref_n.detach())
    assert ours.state[fp8.weight]["step"].dtype == torch.float32


def test_fused_master_adamw_on_fsdp2_shards_steps_like_torchs_fused_adamw(one_rank):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for m in models:
        fully_shard(m)
    ours = MasterAdamW(models[0].parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    ref = torch.optim.AdamW(models[1].parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)
    x = torch.randn(8, 16)
    for _ in range(3):
        for m, opt in zip(models, (ours, ref)):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())


def test_master_adamw_is_fused_exactly_where_torchs_adamw_is():
    """build_optimizer gives torch's AdamW fused=True on CUDA; MasterAdamW decides the same from its parameters'
    device (CPU here: not fused), and keeps that through a state-dict round trip."""
    model = Fp8Linear()
    opt = fp8_optimizer(model)
    assert opt.param_groups[0]["fused"] is False
    assert MasterAdamW._fused_for([torch.empty(1, device="meta")]) is False
    set_grads(model, 0)
    opt.step()
    again = fp8_optimizer(Fp8Linear())
    again.load_state_dict(opt.state_dict())
    assert again.param_groups[0]["fused"] is False
