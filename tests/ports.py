"""The TCP ports this process listens on (Linux /proc): a test worker must not keep one that a Slurm job on this host
will want, or that job's launcher cannot open its rendezvous store (exit 86, requeued until MAX_REQUEUES)."""

from __future__ import annotations

import os
from pathlib import Path

# 1.train_llama.sbatch's rendezvous port is 29500 + job id % 1000 and its preflight's the one after it
JOB_PORTS = range(29500, 30501)
_LISTEN = "0A"  # the TCP state column of /proc/net/tcp


def listening_ports() -> set[int]:
    """The ports of the sockets this process holds open in the LISTEN state."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
