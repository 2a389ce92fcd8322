"""Python's garbage collector at a process's start-up and at its exit: the two moments a command makes, or leaves,
hundreds of thousands of long-lived objects (torch's and transformers' modules, the model), and every collection
then walks all of them.

Measured on a training rank of the tiny model on a CPU node (``benchmarks/bench_exit.py``, ``gc.callbacks``): the
collections that its start-up's allocations triggered took 1.1 s of its 6 s of imports and build, and Python's
shutdown 1-2 s more after its last line (in all, 916, 84 and 6 collections of generations 0, 1 and 2 in a two-step
run; now a few dozen young ones). Neither frees anything that matters: what start-up makes lives for the whole run,
and what a finished command holds goes with the process. The modules a command imported are also frozen in a
program, so that the collections of the command itself do not walk them again (an 8B estimate: 1.1 s of collections
instead of 2.0 s)."""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator
from typing import NoReturn

_program = False  # set by the program's entry (__main__.program): a call into the package from another program
# (a test, a notebook) never freezes its objects


def as_program() -> None:
    """This process is ``python -m llama_fp8`` or the ``llama-fp8`` script: it may freeze its objects."""
    global _program
    _program = True


@contextlib.contextmanager
def paused(freeze: bool = False) -> Iterator[None]:
    """No automatic collection inside; the collector as it was after. What reference counting frees is still freed;
    cyclic garbage made inside waits for the next collection after it. ``freeze``: in a program, what is alive when
    the block ends (the modules a command imported) is frozen, out of every later collection's walk."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze and _program:
            gc.freeze()
    finally:
        if was:
            gc.enable()


def leave(code: int) -> NoReturn:
    """Exit with ``code`` once a command has returned, without the collections of Python's shutdown: the objects
    alive are frozen, out of the walks the shutdown makes while it clears the modules. What an exit must do is still
    done: non-daemon threads are joined, atexit handlers run (weakref finalizers included), the standard streams are
    flushed, and what reference counting frees is freed. Cyclic garbage made before the freeze is not collected;
    every file and store a command writes is closed by the command itself. For a program's last line only (a process
    that goes on would keep that garbage for good)."""
    gc.freeze()
    sys.exit(code)
