"""Is this node, and this job on it, ready to train: ``preflight`` (the command) with ``node_checks`` (what the
node has), ``config_checks`` (the run's decisions, through the plan's own resolvers), ``nccl`` (which network
NCCL really uses), ``netcheck`` (the all-reduce test over the job step), ``fabric`` / ``nvlink`` (a GB200 or GB300
node's NVLink domain and IMEX; the job's domains and NCCL's proof it used them), ``lustre`` (FSx for Lustre under
the run's folders) and ``platform_checks`` (what those give preflight)."""
