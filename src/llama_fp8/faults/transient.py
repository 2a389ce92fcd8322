"""Which failures are the machine's or its services' rather than the run's own: the transient class (exit 75).

A rerun repeats a bad flag, a bad data file or a non-finite loss (exit 2, 3: never restarted); it may well not
repeat an I/O error of a network file system, a Hub that answered 429, CUDA failing to start on one node, a GPU
fallen off the bus, or a peer that died of any of these. ``kind_of`` names the class of an exception (or None
when it is none of these); ``backoff`` retries a call whose failure is a network error; the launcher restarts a
transient failure and counts it against the node it happened on (cluster/launch/elastic.py).

Exceptions are recognized by their type's name and module and by their message, so that this module imports no
optional library (requests, huggingface_hub, CUDA).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

log = logging.getLogger("llama_fp8.faults")
T = TypeVar("T")

KINDS = {"io": "an I/O error", "network": "a network error", "cuda_startup": "CUDA failing to start",
         "device_lost": "a device lost", "peer": "a peer's failure"}
"""The transient classes, as the decision lines name them."""
IO_ERRNOS = {errno.EIO, errno.ESTALE, errno.EREMOTEIO, errno.ENOLINK, errno.ETIMEDOUT, errno.EAGAIN}
"""I/O errors a network or parallel file system returns for a moment (a server failing over, a lost lease)."""
NET_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EHOSTUNREACH, errno.EHOSTDOWN,
              errno.ENETUNREACH, errno.ENETDOWN, errno.ENETRESET, errno.EPIPE}
_CUDA_STARTUP = ("cuda driver initialization failed", "no cuda-capable device is detected", "cudaerrornodevice",
                 "cudaerrorinitializationerror", "cuda error: initialization error", "found no nvidia driver",
                 "cuda unknown error", "cudaerrorsystemnotready", "busy or unavailable", "cudaerrordevicesunavailable",
                 "cuinit")
_DEVICE_LOST = ("unspecified launch failure", "uncorrectable ecc error", "fallen off the bus", "cudaerrorlaunchfailure",
                "cudaerrorecc", "gpu is lost", "cudaerrordevicesunavailable")
_NETWORK = ("temporary failure in name resolution", "max retries exceeded", "read timed out", "connection aborted",
            "ncclsystemerror", "ncclremoteerror", "unhandled system error", "remote process exited or there was a "
            "network error")
_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe")
_S3_TRANSIENT = ("slow down", "slowdown", "slow_down", "throttl", "service unavailable", "internal error",
                 "internalerror", "internal_error", "internal server error",
                 "request timeout", "requesttimeout", "aws_io_", "aws_error_http", "connection", "socket", "timed out",
                 "timeout", "broken pipe", "reset by peer")
"""Words of an S3 error (the AWS CRT client's, as the S3 Connector for PyTorch raises it, after the client's own
retries) that say the service or the network failed for a moment: a 503 Slow Down, a 500, a connection refused or
reset, a timeout. Anything else (Forbidden, NoSuchBucket, a wrong region) is a setting: a rerun repeats it."""
_NETWORK_TYPES = {"ConnectionError", "Timeout", "ReadTimeout", "ConnectTimeout", "ChunkedEncodingError",
                  "MaxRetryError", "ProtocolError", "NewConnectionError", "RemoteDisconnected", "IncompleteRead",
                  "ServerDisconnectedError", "ClientConnectorError", "LocalEntryNotFoundError"}
RETRY_STATUS = {408, 429, 500, 502, 503, 504}
"""HTTP statuses worth another try: a timeout, too many requests, a server or gateway failing for a moment."""
PAUSES = (2.0, 5.0, 15.0, 30.0)
"""``backoff``'s pauses between tries of a network call (about 50 s in all, then the failure stands)."""


class TransientError(RuntimeError):
    """A failure a rerun may well not repeat (the machine, the network, a file system): exit 75. ``kind`` is one of
    ``KINDS``."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind

    def __reduce__(self):  # sent between ranks (pickled) by DCP and all_gather_object
        return type(self), (self.kind, str(self))


class AgreedTransient(TransientError):
    """A transient failure every rank raises together (a peer's, or a checkpoint read or save that failed on some
    rank); rank 0 reports it."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _status(exc: BaseException) -> int | None:
    """The HTTP status of a requests/huggingface_hub error (None when it carries none)."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def kind_of(exc: BaseException) -> str | None:
    """The transient class of ``exc`` (a key of ``KINDS``), looking through its causes; None when it is not one."""
    for e in _chain(exc):
        if isinstance(e, TransientError):
            return e.kind if e.kind in KINDS else "io"
        name, module, text = type(e).__name__, type(e).__module__ or "", str(e).lower()
        if name == "S3Exception":  # s3torchconnectorclient: the status is only in the message
            return "network" if any(p in text for p in _S3_TRANSIENT) and "forbidden" not in text else None
        if "offlinemode" in text.replace(" ", "") or name == "OfflineModeIsEnabled":
            return None  # HF_HUB_OFFLINE set: a setting, not the network
        if isinstance(e, OSError) and e.errno in IO_ERRNOS:
            return "io"
        if isinstance(e, OSError) and e.errno in NET_ERRNOS:
            return "network"
        if any(p in text for p in _CUDA_STARTUP):
            return "cuda_startup"
        if any(p in text for p in _DEVICE_LOST):
            return "device_lost"
        if name == "DistNetworkError" or any(p in text for p in _PEER):
            return "peer"
        status = _status(e)
        if status is not None:
            return "network" if status in RETRY_STATUS else None  # 401, 404: a setting, a rerun repeats it
        if name in _NETWORK_TYPES and module.split(".")[0] in ("requests", "urllib3", "huggingface_hub", "http",
                                                                "aiohttp", "fsspec", "socket", "builtins"):
            return "network"
        if isinstance(e, (TimeoutError, ConnectionError)) or any(p in text for p in _NETWORK):
            return "network"
    return None


def describe(exc: BaseException) -> str:
    """One line: the class (when transient), the exception's type and its last line."""
    kind = kind_of(exc)
    lines = str(exc).strip().splitlines()
    body = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    return f"{KINDS[kind]}: {body}" if kind else body


def as_transient(exc: BaseException, agreed: bool = False) -> TransientError | None:
    """``exc`` as a TransientError (keeping its message), or None when it is not transient."""
    kind = kind_of(exc)
    if kind is None:
        return None
    cls = AgreedTransient if agreed else TransientError
    return exc if isinstance(exc, cls) else cls(kind, describe(exc))


def backoff(fn: Callable[[], T], what: str, pauses: tuple[float, ...] = PAUSES, sleep=time.sleep) -> T:
    """``fn()``, tried again after each of ``pauses`` while it fails with a network error (a Hub answering 429 or
    503, a connection reset); other failures, and the last one, are raised as they are."""
    for pause in (*pauses, None):
        try:
            return fn()
        except Exception as e:
            if pause is None or kind_of(e) != "network":
                raise
            log.warning("%s: %s; trying again in %.0f s", what, describe(e), pause)
            sleep(pause)
    raise AssertionError("unreachable")
