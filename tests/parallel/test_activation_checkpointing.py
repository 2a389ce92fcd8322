"""Each activation checkpointing mode keeps the tensors it names and recomputes the rest: one Hugging Face Llama block
(FP32, CPU), every matmul and attention call recorded with its output's storage. After the forward, the storages
still alive are what the mode keeps for backward; in backward, the matmuls beyond the 2 per linear are its
recomputation."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llama_fp8 import config, models
from llama_fp8.parallel import activation_checkpointing as ac

MATMUL = {"mm", "addmm", "bmm"}


class Calls(TorchDispatchMode):
    """Every matmul and attention op: (phase, op name, output shape, a weak reference to its output's storage)."""

    def __init__(self):
        super().__init__()
        self.phase, self.calls = "forward", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in MATMUL or "scaled_dot_product" in name:
            first = out[0] if isinstance(out, tuple) else out
            self.calls.append((self.phase, name, weakref.ref(first.untyped_storage())))
        return out


def run_block(mode: str) -> tuple[list[str], int]:
    """(what the forward's matmuls and attention were, by Llama name, whose outputs are alive once it returned; the
    matmuls backward ran)."""
    cfg = config.parse_args(["--model", "tiny", "--num_layers", "1", "--bf16", "0"])
    torch.manual_seed(0)
    model = models.get("hf").build(cfg)
    block = ac.wrap(model.model.layers[0], mode)
    x = torch.randn(2, 16, cfg.hidden_width, requires_grad=True)
    positions = torch.arange(16).expand(2, -1)
    rope = model.model.rotary_emb(x, positions)
    calls = Calls()
    with calls:
        y = block(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
        gc.collect()
        names = iter(ac.MATMULS)
        forward = [next(names) if name in MATMUL else "attention" for _, name, _ in calls.calls]
        alive = [n for n, (_, _, storage) in zip(forward, calls.calls) if storage() is not None]
        calls.phase = "backward"
        y.sum().backward()
    assert forward == ["q", "k", "v", "attention", "o", "gate", "up", "down"]
    return alive, sum(1 for phase, name, _ in calls.calls if phase == "backward" and name in MATMUL)


def test_selective_keeps_attention_and_the_named_matmuls_recomputes_up_and_never_down():
    alive, backward_matmuls = run_block("selective")
    assert ac.SELECTIVE_KEEPS == ("q", "k", "v", "o", "gate")
    assert alive == ["q", "k", "v", "attention", "o", "gate"]
    assert backward_matmuls == 2 * 7 + 1  # each linear's two gradients, and up recomputed


def test_full_keeps_nothing_and_recomputes_up_to_the_last_matmul():
    alive, backward_matmuls = run_block("full")
    assert alive == []
    assert backward_matmuls == 2 * 7 + 6  # q ... up recomputed; the recomputation stops before down


def test_none_keeps_what_autograd_saves_and_recomputes_nothing():
    alive, backward_matmuls = run_block("none")
    assert alive == ["v", "attention", "gate", "up"]  # attention's inputs and output, SiLU's and the product's inputs
    assert backward_matmuls == 2 * 7


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_checkpointed_block_computes_what_the_plain_one_does(mode):
    cfg = config.parse_args(["--model", "tiny", "--num_layers", "2", "--bf16", "0"])
    impl = models.get("hf")
    grads = {}
    for m in ("none", mode):
        torch.manual_seed(0)
        model = impl.build(cfg)
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = ac.wrap(layer, m)
        ids = torch.randint(0, cfg.vocab_size, (2, 16))
        loss = impl.loss(model, impl.model_inputs(ids), ids.roll(-1, 1))
        loss.backward()
        grads[m] = (loss.item(), [p.grad.clone() for p in model.parameters()])
    assert grads[mode][0] == grads["none"][0]
    for got, want in zip(grads[mode][1], grads["none"][1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
