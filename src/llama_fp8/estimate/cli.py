"""``python -m llama_fp8 estimate [train flags] [--nodes N --gpus_per_node G --gpu NAME --json]``.

Exit codes (errors.py): 0 the run fits (or is tight: it fits without the allocator margin), 4 it does not fit, 5 it
does not fit as estimated through a stand-in (the job's implementation cannot run here) while what any
implementation holds does (an approximation, stated; the batch scripts and ``submit`` stop on it as on 4 unless told
to go on), 2 a flag the training run
itself would refuse or that cannot be estimated (the message names it). The report (or JSON) goes to stdout,
progress to stderr.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator

from llama_fp8.errors import EXIT_BAD_CONFIG, EXIT_DOES_NOT_FIT, EXIT_STAND_IN_DOES_NOT_FIT, ConfigError
from llama_fp8.estimate.flags import parse_estimate_args

__all__ = ["EXIT_DOES_NOT_FIT", "EXIT_STAND_IN_DOES_NOT_FIT", "main"]


def _progress(start: float):
    def say(msg: str) -> None:
        print(f"[estimate {time.perf_counter() - start:6.1f} s] {msg}", file=sys.stderr, flush=True)
    return say


QUIETED = ("llama_fp8", "torch.distributed.tensor._redistribute", "torchao", "torch.utils._pytree")


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """The estimate's own output only: the training path's INFO lines, torchao's "FP8 is EMULATED" warning (true
    here and meaningless for a GPU estimate), DTensor's advice about 2-D reductions and torchao's deprecated enum
    registrations (torch's pytree, on import) stay out of it. Only while it runs: ``submit`` estimates in its own
    process, and its logging (levels and the root's handlers) must come back as it was."""
    root = logging.getLogger()
    handlers, levels = list(root.handlers), {name: logging.getLogger(name).level for name in QUIETED}
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in QUIETED:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)


def main(argv: list[str]) -> int:
    try:
        cfg, opts = parse_estimate_args(argv)
    except ConfigError as e:
        print(f"llama-fp8 estimate: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    start = time.perf_counter()
    say = _progress(start)
    from llama_fp8.estimate import assess, report, suggest

    try:
        with _quiet_libraries():
            est = assess.estimate(cfg, opts, say)
            if opts.suggest and est.verdict.status != "fits":
                est.suggestions = suggest.suggest(est, say)
                est.seconds = time.perf_counter() - start
    except ConfigError as e:
        print(f"llama-fp8 estimate: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(json.dumps(report.to_dict(est)) if opts.json else report.text(est), flush=True)
    if est.fits:
        return 0
    return EXIT_DOES_NOT_FIT if est.decided else EXIT_STAND_IN_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
