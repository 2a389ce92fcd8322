"""BF16 exceptions by layer (``--fp8_exclude PATTERNS``): comma-separated globs on module names
(``model.layers.0.*,model.layers.31.*``) whose layers stay in high precision on either FP8 backend.

torchao: an excluded ``nn.Linear`` is left out of the ``Float8Linear`` conversion. Transformer Engine: an
excluded module runs its forward under a nested ``autocast(enabled=False)``, TE's documented way to run
part of a model outside FP8 (its backward follows what the forward recorded).
"""

from __future__ import annotations

import fnmatch
import functools
import re

from torch import nn

from llama_fp8.errors import ConfigError

_GLOB_CHARS = re.compile(r"^[A-Za-z0-9_.*?\[\]!-]+$")
MAX_PATTERNS = 1024


def parse(text: str | None) -> tuple[str, ...]:
    """The patterns of ``--fp8_exclude`` (empty when not given); ConfigError on an empty item or a
    character that cannot be in a module name or a glob."""
    if text is None or not text.strip():
        return ()
    items = [p.strip() for p in text.split(",")]
    if len(items) > MAX_PATTERNS:
        raise ConfigError(f"--fp8_exclude: {len(items)} patterns; at most {MAX_PATTERNS}")
    for p in items:
        if not p or not _GLOB_CHARS.match(p):
            raise ConfigError(f"--fp8_exclude: {p!r} is not a module-name glob (letters, digits, _ . - and the glob "
                              f"characters * ? [ ] !, comma-separated; e.g. model.layers.0.*,model.layers.31.*)")
    return tuple(dict.fromkeys(items))


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
