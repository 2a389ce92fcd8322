"""BF16 exceptions by layer (``--fp8_exclude PATTERNS``): comma-separated globs on module names
(``model.layers.0.*,model.layers.31.*``) whose layers stay in high precision on either FP8 backend, and the
readable form of the BF16 tail that published low-precision recipes keep: ``last:15%`` (the last 15 % of the
decoder blocks, rounded up: blocks 27-31 of 32, as torchtitan's NVFP4 recipe) or ``last:4`` (the last 4 blocks).
The output layer is never converted by either backend, so a tail keeps "the last blocks and the output layer".

torchao: an excluded ``nn.Linear`` is left out of the ``Float8Linear`` conversion. Transformer Engine: an
excluded module runs its forward under a nested ``autocast(enabled=False)``, TE's documented way to run
part of a model outside FP8 (its backward follows what the forward recorded).
"""

from __future__ import annotations

import fnmatch
import functools
import math
import re

from torch import nn

from llama_fp8.errors import ConfigError

_GLOB_CHARS = re.compile(r"^[A-Za-z0-9_.*?\[\]!-]+$")
MAX_PATTERNS = 1024


_TAIL = re.compile(r"^last:(\d+(?:\.\d+)?)(%?)$")
BLOCKS = "model.layers"  # the decoder blocks' module names in every implementation (as LlamaForCausalLM)


def parse(text: str | None, num_layers: int | None = None) -> tuple[str, ...]:
    """The patterns of ``--fp8_exclude`` (empty when not given), a ``last:`` tail expanded to one glob per block
    (needs ``num_layers``); ConfigError on an empty item or a character that cannot be in a module name or a glob."""
    if text is None or not text.strip():
        return ()
    items = [p.strip() for p in text.split(",")]
    if len(items) > MAX_PATTERNS:
        raise ConfigError(f"--fp8_exclude: {len(items)} patterns; at most {MAX_PATTERNS}")
    out: list[str] = []
    for p in items:
        if p.startswith("last:"):
            out += [f"{BLOCKS}.{i}.*" for i in _tail(p, num_layers)]
        elif not p or not _GLOB_CHARS.match(p):
            raise ConfigError(f"--fp8_exclude: {p!r} is not a module-name glob (letters, digits, _ . - and the glob "
                              f"characters * ? [ ] !, comma-separated; e.g. model.layers.0.*,model.layers.31.*) nor "
                              f"a BF16 tail (last:15% or last:4)")
        else:
            out.append(p)
    return tuple(dict.fromkeys(out))


def tail_layers(text: str | None, num_layers: int) -> tuple[int, ...]:
    """The decoder blocks a ``last:`` item of ``--fp8_exclude`` keeps in BF16 (empty without one)."""
    items = [p.strip() for p in (text or "").split(",") if p.strip().startswith("last:")]
    return tuple(sorted({i for p in items for i in _tail(p, num_layers)}))


def _tail(item: str, num_layers: int | None) -> range:
    m = _TAIL.match(item)
    if m is None:
        raise ConfigError(f"--fp8_exclude: {item!r}: a BF16 tail is last:P% (a percentage of the decoder blocks, "
                          f"0 < P <= 100) or last:N (a number of blocks), e.g. last:15%")
    if num_layers is None:  # a flags-only check: the form is valid, the count waits for the model
        return range(0)
    value = float(m.group(1))
    if m.group(2):
        if not 0 < value <= 100:
            raise ConfigError(f"--fp8_exclude {item}: the percentage must be > 0 and <= 100")
        count = math.ceil(num_layers * value / 100 - 1e-9)  # 15 % of 32 blocks: 5 (27-31), as torchtitan's recipe
    else:
        if value != int(value) or not 0 < value <= num_layers:
            raise ConfigError(f"--fp8_exclude {item}: a whole number of blocks from 1 to {num_layers} (the model's "
                              f"decoder blocks)")
        count = int(value)
    return range(num_layers - count, num_layers)


def tail_text(layers: tuple[int, ...], num_layers: int) -> str:
    """``blocks 27-31 of 32 and the output layer`` (the record config.yaml and the report show)."""
    if not layers:
        return ""
    span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"{layers[0]}"
    return f"decoder blocks {span} ({len(layers)} of {num_layers}) and the output layer in BF16"


def match(name: str, patterns: tuple[str, ...]) -> str | None:
    """The first pattern that matches module name ``name``, or None."""
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def check_all_match(patterns: tuple[str, ...], names: list[str]) -> None:
    """A pattern that matches no layer is a typo, not a no-op: ConfigError naming it and some valid names."""
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unused:
        sample = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ConfigError(f"--fp8_exclude: {', '.join(unused)} matches no FP8-capable layer of this model (its "
                          f"layers are named like {sample})")


def disable_fp8_in(model: nn.Module, patterns: tuple[str, ...], fp8_off) -> list[str]:
    """Transformer Engine: run the forward of every module whose name matches under ``fp8_off()`` (a
    nested FP8 autocast with enabled=False). Returns the names so wrapped (outermost matches only)."""
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if not name or not match(name, patterns) or any(name.startswith(w + ".") for w in wrapped):
            continue
        module.forward = _without_fp8(module.forward, fp8_off)
        wrapped.append(name)
    return wrapped


def _without_fp8(forward, fp8_off):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with fp8_off():
            return forward(*args, **kwargs)

    run.fp8_disabled = True  # read by the coverage count (precision/verify.py)
    return run
