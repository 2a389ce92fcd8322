"""Run under torchrun by test_distributed.py: the real train() on each rank, then this rank's summary
(the rank-averaged losses it logged, the parameter elements it holds) as JSON in OUT_DIR/rank<N>.json."""

import json
import sys
from pathlib import Path

from llama_fp8 import config, faults, parallel, train
from llama_fp8.collector import leave


def run_rank(out_dir: Path, argv: list[str]) -> None:
    cfg = config.parse_args(argv)
    env = parallel.init_distributed(cfg)
    try:
        summary = train.train(cfg, env)
        summary["group_timeouts"] = faults.group_timeouts()  # every process group the run created, and its timeout
    finally:
        parallel.destroy_distributed()
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps({"rank": env.rank, **summary}))


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]), sys.argv[2:])
    leave(0)  # as `python -m llama_fp8` leaves: without the shutdown's collections
