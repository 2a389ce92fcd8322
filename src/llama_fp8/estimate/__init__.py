"""``llama-fp8 estimate``: will a training run fit, and what does one step send, from a machine without a GPU.

The training program's own build path and step run in one process as rank 0 of the job's world, on torch's fake
process group and fake CPU tensors, under PyTorch's FSDPMemTracker; what the tracker cannot see on a GPU is
added as named terms with their sources; the verdict compares the sum with the GPU's memory.

    flags.py      the train flags + nodes, GPUs per node, GPU, --json, --suggest
    build.py      what is built (the plan's decisions; a stand-in where the implementation cannot run on CPU)
    fake.py       the fake process group and the fake tensor mode
    corrections.py  where fake tensors make a library take another path than real ones, the real path
    tracker.py    FSDPMemTracker + where the peak was + the collectives of the step
    run.py        one measurement: build, materialize, warm-up step, tracked step (fake, or real for the tests)
    gpus.py       GPU memory and bandwidths
    terms.py      what the tracker cannot see on a GPU, sized and sourced; the verdict
    report.py     the estimate as text and JSON
    suggest.py    what would make it fit, each estimated
    cli.py        the command
    table.py      docs/estimate.md's table: the smallest layout that fits, per preset

This package's ``__init__`` imports nothing, so that the flags can read the GPU table without an import cycle.
"""
