"""Starting and supervising jobs: ``torchrun`` (``llama-fp8 launch``: torchrun with the agent of ``elastic``),
``elastic`` (restarts inside the allocation), ``submit`` (submitit), ``job_lib.sh`` (the batch scripts' steps),
``schedule`` (the run order of a repeated A/B, read by the launch scripts), ``mounts`` (what a container must
mount)."""
