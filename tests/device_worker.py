"""Run under torchrun by test_distributed.py: ``parallel.init_distributed`` with --device auto where CUDA "starts"
only on the ranks listed in DEVICE_WORKER_CUDA (this CPU machine has none: ``cuda_state`` is replaced); writes what
each rank got to OUT_DIR/rank<N>.json."""

import json
import os
import sys
from pathlib import Path

from llama_fp8 import config, faults
from llama_fp8.parallel import dist as D

if __name__ == "__main__":
    out_dir, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    good = {int(r) for r in os.environ["DEVICE_WORKER_CUDA"].split(",") if r}
    D.cuda_state = lambda local_rank: (True, "1 CUDA device(s)") if rank in good else (
        False, "CUDA initialization: CUDA driver initialization failed, you might not have a CUDA gpu.")
    try:
        env = D.init_distributed(config.parse_args(["--device", "auto", *sys.argv[2:]]))
        seen = {"device": env.device.type}
        # with a barrier: gloo's group is made pair by pair, and a rank that closed its group as soon as its own
        # pairs were up cut the other's last connection ("Connection closed by peer", once in a CI-like run)
        D.destroy_distributed(barrier=True)
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        seen = {"raised": type(e).__name__, "kind": faults.kind_of(e), "message": str(e)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(seen))
