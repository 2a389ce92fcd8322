"""AdamW with FP32 master weights for FP8 primary weights (``--fp8_all_gather 1`` with the TE model).

A weight held in FP8 (E4M3, 3 mantissa bits) cannot absorb an update smaller than half of its quantization
step: applying AdamW to it directly (dequantize, update, re-quantize) rounds most small updates away, and
training silently stops moving those weights. So, as TE's own FSDP2 tests do with ``FusedAdam(master_weights=
True)``, each FP8 parameter gets an FP32 master copy in the optimizer state: AdamW updates the master, and the
FP8 parameter is re-quantized from it after every step (``quantize_``, TE's QuantizedTensor API). Every other
parameter is updated in place as by ``torch.optim.AdamW``.

The state lives under the model's own parameters (``state[p] = {step, exp_avg, exp_avg_sq[, master]}``), so
``torch.distributed.checkpoint`` saves and restores the masters with the moments, sharded like the parameters
(DTensors on the same mesh and placements)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from llama_fp8.models.te.fp8 import params as fp8_params

FLOAT_STATES = ("exp_avg", "exp_avg_sq", "master")


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: an FSDP2 parameter's local shard, else the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def is_quantized(p: torch.Tensor) -> bool:
    """A parameter stored quantized (TE's QuantizedTensor: FP8 data that ``quantize_`` rewrites in place)."""
    return callable(getattr(local(p), "quantize_", None)) and callable(getattr(local(p), "dequantize", None))


def _like(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a local tensor) shaped and placed as parameter ``p``: a DTensor for a DTensor parameter."""
    if isinstance(p, DTensor):
        return DTensor.from_local(value, p.device_mesh, p.placements, shape=p.size(), stride=p.stride())
    return value


class MasterAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's own update math) keeping an FP32 master of every quantized
    parameter; the quantized parameter is re-quantized from its master after each step."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool | None = None):
        """``fused``: torch's fused AdamW kernel (None: where every parameter is on CUDA, as ``build_optimizer``
        gives every other run ``torch.optim.AdamW(fused=True)`` on CUDA, so that A/B step times differ by
        precision, not by the optimizer's implementation)."""
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "fused": fused})
        for group in self.param_groups:
            if group["fused"] is None:
                group["fused"] = self._fused_for(group["params"])

    @staticmethod
    def _fused_for(params) -> bool:
        return bool(params) and all(p.device.type == "cuda" for p in params)

    def _init_state(self, p: torch.Tensor, fused: bool = False) -> dict:
        """The parameter's state, created at its first step. A quantized parameter always gets its master here,
        also when its moments came from a state without one (e.g. loaded from torch's AdamW)."""
        state = self.state[p]
        quantized = is_quantized(p)
        if state and (not quantized or "master" in state):
            return state
        # fused: the step count lives on the parameter's device, as torch.optim.AdamW keeps it
        state.setdefault("step", torch.tensor(0.0, dtype=torch.float32, device=p.device if fused else None))
        if quantized:  # moments and master in FP32, shaped as the parameter's dequantized values
            # A fresh state starts from the weight's initial values before quantization (what its BF16 partner
            # starts from); a state whose moments were loaded without a master, from the weight as it is now.
            initial = fp8_params.initial_values(p) if "exp_avg" not in state else None
            master = initial if initial is not None else local(p).dequantize(dtype=torch.float32)
            for name in ("exp_avg", "exp_avg_sq"):
                old = state.get(name)
                state[name] = _like(p, local(old).float() if old is not None else torch.zeros_like(master))
            state["master"] = _like(p, master)  # both sources return a fresh tensor: no copy
        else:  # as torch.optim.AdamW
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            targets, grads, avgs, sqs, steps, requantize = [], [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p, group["fused"])
                if "master" in state:
                    targets.append(state["master"])
                    grads.append(p.grad.float())
                    requantize.append((p, state["master"]))
                else:
                    targets.append(p)
                    grads.append(p.grad)
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if not targets:
                continue
            beta1, beta2 = group["betas"]
            adamw(targets, grads, avgs, sqs, [], steps, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, fused=group["fused"])
            for p, master in requantize:
                local(p).quantize_(local(master))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state to its parameter's dtype (an FP8 parameter reports its
        nominal BF16/FP32 dtype): put the moments and masters back in FP32, from the saved values."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        for index, p in zip(saved, params):
            values = state_dict["state"].get(index, {})
            for name in FLOAT_STATES:
                if name in values and is_quantized(p):
                    self.state[p][name] = values[name].to(device=local(p).device, dtype=torch.float32)
