"""Is this node, and this job on it, ready to train: ``preflight`` (the command) with ``node_checks`` (what the
node has), ``config_checks`` (the run's decisions, through the plan's own resolvers), ``nccl`` (which network
NCCL really uses) and ``netcheck`` (the all-reduce test over the job step)."""
