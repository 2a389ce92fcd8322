"""One rank of the real run the equality tests compare the estimate with: ``torchrun --nproc_per_node 2
real_worker.py OUT.json 'JSON list of train flag lists'``. The process group is gloo (real collectives, real CPU
tensors); each configuration runs ``estimate.run.measure(..., fake_run=False)``: the same build and steps as the
estimate, with real tensors and no fake-mode correction. Rank 0 writes one record per configuration."""

from __future__ import annotations

import dataclasses
import json
import sys

from llama_fp8 import config, parallel
from llama_fp8.estimate import run


def record(m: run.Measurement) -> dict:
    return {"peak_bytes": m.peak_bytes, "by_kind": m.by_kind, "at_optimizer": m.at_optimizer,
            "where": dataclasses.asdict(m.where), "collectives": m.collectives, "local_param_numel": m.local_param_numel}


def main(out: str, configs: str) -> None:
    results = []
    env = None
    for args in json.loads(configs):
        cfg = config.parse_args(args)
        if env is None:
            env = parallel.init_distributed(cfg)
        results.append(record(run.measure(cfg, env, fake_run=False)))
    if env.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    parallel.destroy_distributed(barrier=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
