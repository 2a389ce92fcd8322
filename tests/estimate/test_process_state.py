"""An estimate run in-process (submit calls it before queueing) leaves the process's logging as it found it: it
quiets the training path's INFO lines only while it runs. It once left the `llama_fp8` logger at ERROR, and every
later test that read a warning from the log saw nothing."""

from __future__ import annotations

import logging

from llama_fp8.estimate import cli

TINY = ["--model", "tiny", "--num_layers", "2", "--max_context_width", "128", "--train_batch_size", "2"]
QUIETED = ("llama_fp8", "torch.distributed.tensor._redistribute", "torchao")


def test_an_estimate_leaves_the_loggers_levels_as_they_were(capsys):
    before = {name: logging.getLogger(name).level for name in QUIETED}
    root = (logging.getLogger().level, list(logging.getLogger().handlers))
    assert cli.main([*TINY, "--suggest", "0"]) == 0
    capsys.readouterr()
    assert {name: logging.getLogger(name).level for name in QUIETED} == before
    assert (logging.getLogger().level, list(logging.getLogger().handlers)) == root


def test_a_refused_estimate_leaves_them_too(capsys):
    before = {name: logging.getLogger(name).level for name in QUIETED}
    assert cli.main([*TINY, "--nodes", "0"]) == 2
    capsys.readouterr()
    assert {name: logging.getLogger(name).level for name in QUIETED} == before
