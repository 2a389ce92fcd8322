"""The tokenizer: AutoTokenizer from a local folder or a hub id, checked for what packing needs."""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from llama_fp8 import faults
from llama_fp8.data.files import is_local


@lru_cache(maxsize=4)
def load_tokenizer(name: str) -> Any:
    """AutoTokenizer from a local folder or hub id, with truncation/padding of the backend off."""
    from transformers import AutoTokenizer

    if is_local(name) and not os.path.isdir(os.path.expanduser(name)):
        raise ValueError(f"--tokenizer={name!r}: no such directory")
    try:  # a hub id: a network error is tried again with a backoff, then raised as transient (exit 75)
        tok = faults.backoff(lambda: AutoTokenizer.from_pretrained(os.path.expanduser(name) if is_local(name)
                                                                   else name), f"--tokenizer={name!r}")
    except Exception as e:
        transient = faults.as_transient(e)
        if transient is not None:
            raise transient from e
        raise ValueError(f"--tokenizer={name!r} cannot be loaded: {type(e).__name__}: {e}") from e
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:  # packing needs whole documents, never truncated or padded ones
        backend.no_truncation()
        backend.no_padding()
    return tok


def check_tokenizer(tok: Any, name: str, vocab_size: int | None) -> None:
    """The packer needs an EOS token and ids that fit the model's embedding (None: not checked)."""
    if tok.eos_token_id is None:
        raise ValueError(f"--tokenizer={name!r} defines no EOS token; packing separates documents "
                         "with EOS (set eos_token in its tokenizer_config.json)")
    if vocab_size is not None and len(tok) > vocab_size:
        raise ValueError(f"--tokenizer={name!r} has {len(tok)} tokens, more than the model's "
                         f"vocab_size={vocab_size}; use a model preset with vocab_size >= {len(tok)}")


def tokenizer_sha256(tok: Any) -> str:
    """What identifies a tokenizer's token ids, wherever it was loaded from: SHA-256 of its serialized vocabulary and
    merges (the fast tokenizer's JSON; a slow one's vocabulary), its size and its BOS/EOS ids."""
    import hashlib
    import json

    backend = getattr(tok, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    extra = json.dumps([len(tok), tok.bos_token_id, tok.eos_token_id])
    return hashlib.sha256((body + extra).encode()).hexdigest()
