"""Exit codes and the user-error exception, shared by every command (a module without imports, so
that any module can use them without an import cycle)."""

from __future__ import annotations

EXIT_BAD_CONFIG = 2
"""Exit code of a user error (a flag, a file, a path): reported in one line naming it."""
EXIT_REQUEUE = 85
"""Exit code meaning "checkpoint saved after SIGUSR1/SIGTERM, requeue me" (read by 1.train_llama.sbatch)."""
EXIT_NONFINITE = 3
"""Exit code of a run stopped by a non-finite loss or gradient norm (--nan_policy error)."""
EXIT_DOES_NOT_FIT = 4
"""``llama_fp8 estimate``: the configuration does not fit the GPU's memory (the batch scripts' pre-job check and
``submit`` stop on it)."""
EXIT_TRANSIENT = 75
"""Exit code of a failure of the machine or its services, not of the config (sysexits' EX_TEMPFAIL): an I/O error,
the network, CUDA failing to start, a device lost, a peer's failure (``faults.transient`` names the class). The
launcher restarts the workers and counts the failure against the node it happened on; a rerun may well succeed."""
EXIT_STAND_IN_DOES_NOT_FIT = 5
"""``llama_fp8 estimate``: it does not fit as estimated through a stand-in implementation, while what any
implementation holds does (an approximation, said so; the batch scripts' pre-job check and ``submit`` stop on it too,
unless told to go on)."""


class ConfigError(ValueError):
    """A user error in flags or config files: reported in one line, exit code 2."""


class AgreedError(ConfigError):
    """A start-up error raised on every rank together (``parallel.on_every_rank``); rank 0 reports it."""
