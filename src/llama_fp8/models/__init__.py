"""Model implementations behind one interface (``spec.ModelImpl``), and the registry that picks one.

Built in: ``te`` (Transformer Engine blocks) and ``hf`` (Hugging Face LlamaForCausalLM), tried in that
order by ``--model_impl auto``; ``register`` adds another (tests add a toy one). Nothing outside this
package compares implementation names: everything else asks the implementation object.
"""

from __future__ import annotations

import torch

from llama_fp8.errors import ConfigError
from llama_fp8.models.spec import ModelImpl

_REGISTRY: dict[str, ModelImpl] = {}


def register(impl: ModelImpl) -> ModelImpl:
    """Add an implementation (after the built-in ones for ``auto``); re-registering a name replaces it."""
    if not impl.name:
        raise ValueError("a model implementation needs a name")
    _builtin()
    _REGISTRY[impl.name] = impl
    return impl


def implementations() -> tuple[ModelImpl, ...]:
    _builtin()
    return tuple(_REGISTRY.values())


def names() -> tuple[str, ...]:
    return tuple(i.name for i in implementations())


def get(name: str) -> ModelImpl:
    impls = {i.name: i for i in implementations()}
    if name not in impls:
        raise ConfigError(f"--model_impl {name!r} is not valid; valid: auto, {', '.join(impls)}")
    return impls[name]


def resolve(name: str, device: torch.device) -> ModelImpl:
    """``auto`` -> the first implementation eligible on ``device``. Never looks at --fp8, so both halves
    of an A/B pair get the same implementation."""
    if name != "auto":
        return get(name)
    for impl in implementations():
        if impl.auto_eligible(device):
            return impl
    raise ConfigError(f"--model_impl auto: no implementation can run on {device}")


def help_text() -> str:
    parts = [f"{i.name} ({i.description})" for i in implementations()]
    rule = "; ".join(f"{i.name} {i.auto_when}" for i in implementations())
    return f"model implementation: {', '.join(parts)}, auto ({rule})"


def _builtin() -> None:
    if _REGISTRY:
        return
    from llama_fp8.models.hf import IMPL as HF
    from llama_fp8.models.te import IMPL as TE

    # Order matters for --model_impl auto: TE where it can run, else Hugging Face.
    _REGISTRY.update({TE.name: TE, HF.name: HF})
