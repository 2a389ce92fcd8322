"""One rank of the real runs the equality tests compare the estimate with: ``torchrun --nproc_per_node 2
real_worker.py OUT_DIR 'JSON list of train flag lists' ['JSON train flag list' RUN_DIR]``. The process group is
gloo (real collectives, real CPU tensors).

- Each configuration of the list runs ``estimate.run.measure(..., fake_run=False)``: the same build and steps as
  the estimate, with real tensors and no fake-mode correction.
- The optional last one is ``llama_fp8 train`` itself (``train.main``: the plan, ``train.state.start``'s build,
  optimizer and data loader, ``loop.loop``) for 2 steps into RUN_DIR, with step 2 run under the estimate's
  tracker: what the estimate's own set-up (random-token batches, its optimizer and state) could hide shows there.
  It runs last: training ends by leaving the process group.

Every rank writes its own ``OUT_DIR/rank<r>.json``, ``{"measured": [record per configuration], "trained": record or
null}``: the test compares each rank's, not rank 0's alone (a rank that differs from rank 0 is what an estimate of
rank 0 could hide)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from llama_fp8 import config, parallel
from llama_fp8.collector import leave
from llama_fp8.estimate import run
from llama_fp8.estimate.tracker import StepTracker


def record(m) -> dict:
    """The compared numbers of a Measurement (or of a tracker's summary, as a namespace)."""
    return {"peak_bytes": m.peak_bytes, "by_kind": m.by_kind, "at_optimizer": m.at_optimizer,
            "where": dataclasses.asdict(m.where), "collectives": m.collectives, "local_param_numel": m.local_param_numel}


class _Counted:
    """Training's batches, telling the tracker as each micro-batch is fetched (as the estimate's batches do)."""

    def __init__(self, batches, tracker: StepTracker):
        self.batches, self.tracker = batches, tracker

    def __next__(self):
        self.tracker.next_micro_batch()
        return next(self.batches)


def train_record(args: list[str], run_dir: str) -> dict | None:
    """``llama_fp8 train ARGS --max_steps 2 --run_dir RUN_DIR`` in this process, step 2 under the tracker."""
    from types import SimpleNamespace

    from llama_fp8 import train
    from llama_fp8.train import build as train_build
    from llama_fp8.train import loop

    seen: dict = {}
    real_step, real_sharded = loop.train_step, train_build.build_sharded

    def build_sharded(*a, **k):
        out = real_sharded(*a, **k)
        seen["mesh"] = out[3]
        return out

    def train_step(s, batches, step):
        if step != 2:
            return real_step(s, batches, step)
        names, _ = run.mesh_groups(seen["mesh"], s.plan.dims, s.env.rank)
        tracker = StepTracker(s.model, s.optimizer, names)
        with tracker:
            out = real_step(s, _Counted(batches, tracker), step)
        seen.update(tracker.summary(), local_param_numel=train_build.local_numel(s.model))
        return out

    loop.train_step, train_build.build_sharded = train_step, build_sharded
    try:
        code = train.main([*args, "--max_steps", "2", "--run_dir", run_dir, "--logging_freq", "1"])
    finally:
        loop.train_step, train_build.build_sharded = real_step, real_sharded
    assert code == 0, f"train exited with {code}"
    return record(SimpleNamespace(**seen))


def main(out: str, configs: str, train_args: str | None = None, run_dir: str | None = None) -> None:
    measured = []
    env = None
    for args in json.loads(configs):
        cfg = config.parse_args(args)
        if env is None:
            env = parallel.init_distributed(cfg)
        # Twice, and the lower peak kept: a gloo worker thread can drop its reference to a collective's buffer after
        # the wait on it returned, so on a busy machine a buffer may still be alive at the peak (seen: 58,112 bytes
        # in 1 of 4 tensor-parallel runs beside two busy processes). A late free only ever raises the peak; two
        # runs both late is rare, and the test then fails rather than passing wrongly.
        runs = [record(run.measure(cfg, env, fake_run=False)) for _ in range(2)]
        measured.append(min(runs, key=lambda r: r["peak_bytes"]))
    trained = train_record(json.loads(train_args), run_dir) if train_args else None
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"measured": measured, "trained": trained}, f)
    if env is not None and trained is None:
        parallel.destroy_distributed(barrier=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
    leave(0)  # as `python -m llama_fp8` leaves: without the shutdown's collections
