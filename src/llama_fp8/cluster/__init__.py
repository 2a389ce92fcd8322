"""Running on a cluster: the torchrun wrapper that keeps exit codes (launch), submitit submission (submit),
node checks (preflight) and what they need."""
