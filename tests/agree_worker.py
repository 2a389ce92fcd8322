"""Run under torchrun by test_distributed.py: ``parallel.on_every_rank`` with a check that fails on one
rank only; writes what each rank saw to OUT_DIR/rank<N>.json."""

import errno
import json
import os
import sys
from pathlib import Path

from llama_fp8 import config, parallel


def outcome(env: parallel.DistEnv, check) -> dict:
    try:
        return {"result": parallel.on_every_rank(env, check)}
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        return {"raised": type(e).__name__, "message": str(e), **({"kind": e.kind} if hasattr(e, "kind") else {})}


def fail_on(rank: int, env: parallel.DistEnv, error: Exception):
    def check():
        if env.rank == rank:
            raise error
        return f"ok on {env.rank}"
    return check


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    env = parallel.init_distributed(config.parse_args(["--device", "cpu"]))
    try:
        seen = {"all_ok": outcome(env, lambda: env.rank * 10),
                "config_error_on_1": outcome(env, fail_on(1, env, config.ConfigError("--dataset=/nope: missing"))),
                "crash_on_0": outcome(env, fail_on(0, env, RuntimeError("disk on fire"))),
                "eio_on_0": outcome(env, fail_on(0, env, OSError(errno.EIO, os.strerror(errno.EIO))))}
    finally:
        parallel.destroy_distributed()
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(seen))
