"""What goes wrong in a run and how it is seen, one job per module: ``signals`` (Slurm's preemption and time-limit
signals, agreed across ranks), ``nan_guard`` (non-finite losses and gradient norms), ``timeouts`` (the collective
timeout), ``inject`` (the fault-injection language of tests and drills). The names are re-exported here."""

from llama_fp8.faults.inject import (
           ACTIONS,
           FAULT_DIR_ENV,
           FAULT_ENV,
           FAULT_NAN_ENV,
           POINTS,
           Fault,
           at,
           parse_faults,
)
from llama_fp8.faults.nan_guard import NanGuard, NonFinite
from llama_fp8.faults.signals import Preempted, SignalWatch
from llama_fp8.faults.timeouts import (
           apply_timeouts,
           collective_timeout,
           collective_timeout_message,
           group_timeouts,
)
from llama_fp8.faults.transient import (
           KINDS,
           AgreedTransient,
           TransientError,
           as_transient,
           backoff,
           describe,
           kind_of,
)

__all__ = ["ACTIONS", "FAULT_DIR_ENV", "FAULT_ENV", "FAULT_NAN_ENV", "KINDS", "POINTS", "AgreedTransient", "Fault",
           "NanGuard", "TransientError",
           "NonFinite", "Preempted", "SignalWatch", "apply_timeouts", "as_transient", "at", "backoff",
           "collective_timeout", "collective_timeout_message", "describe", "group_timeouts", "kind_of", "parse_faults"]
