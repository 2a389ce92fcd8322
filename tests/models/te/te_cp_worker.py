"""Run under torchrun by test_te_real_parallel.py (make test-te): the real TE Llama built as training builds
it, with context parallelism over every rank (gloo, CPU; TE's CUDA stream mocked, nothing runs on CUDA).
Writes what TE's attention modules were given and the RoPE length the first layer receives to OUT/rankN.json."""

import json
import os
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import transformer_engine.pytorch  # noqa: F401  (torch first: TE finds libnccl through torch)

from llama_fp8 import config, models, parallel


class Stop(Exception):
    pass


def main(out: Path, comm: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config.parse_args(["--model", "tiny", "--num_layers", "2", "--model_impl", "te", "--device", "cpu",
                             "--cp_size", str(world), "--cp_comm_type", comm, "--max_context_width", "64"])
    env = parallel.DistEnv(rank, rank, world, world, torch.device("cpu"))
    dims = parallel.ParallelDims.from_config(cfg, env)
    impl = models.get("te")
    with mock.patch.object(torch.cuda, "is_available", return_value=True), torch.device("meta"):
        model = impl.build(cfg)
    mesh = parallel.build_mesh(dims, env)
    with mock.patch.object(torch.cuda, "Stream", lambda: "cp-stream"):
        context = parallel.parallelize(model, impl, mesh, cfg, dims)
    impl.materialize(model, torch.device("cpu"), cfg)
    impl.init_weights(model, cfg, torch.device("cpu"))
    seen = {}

    def hook(module, args, kwargs):
        seen["rope_len"] = kwargs["rotary_pos_emb"].shape[0]
        seen["tokens"] = args[0].shape[1]
        raise Stop

    model.model.layers[0].te_layer.register_forward_pre_hook(hook, with_kwargs=True)
    ids = torch.arange(64).view(1, 64)
    with context.step(impl.model_inputs(ids), ids) as (inputs, labels):
        try:
            model(**inputs)
        except Stop:
            pass
    attn = model.model.layers[1].te_layer.self_attention
    core = attn.core_attention
    groups = core.cp_group if isinstance(core.cp_group, list) else [core.cp_group]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "mode": context.cp_mode, "cp_size": attn.cp_size, "cp_rank": attn.cp_rank, "ranks": core.cp_global_ranks,
        "comm": core.cp_comm_type, "stream": core.cp_stream, "group_ranks": [dist.get_process_group_ranks(g)
                                                                            for g in groups],
        "labels": labels.view(-1).tolist(), **seen}))
    dist.destroy_process_group()
    # The TE modules still hold the CP sub-groups, so their gloo worker threads are torn down only at
    # interpreter finalization, where destroying what they hold can abort the process ("terminate called
    # without an active exception", about one run in 25 with four ranks on two cores) after every result
    # was written. Nothing is left to do: leave without finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
