"""The transient class (faults/transient.py): which failures are the machine's or its services' (exit 75,
restarted) and which a rerun would repeat (exit 2); a network call tried again with a backoff."""

from __future__ import annotations

import errno
import types

import pytest

from llama_fp8 import faults
from llama_fp8.faults.transient import AgreedTransient, TransientError


def http_error(status: int) -> Exception:
    """An exception shaped like requests' / huggingface_hub's HTTP errors (a response with a status code)."""
    e = type("HfHubHTTPError", (Exception,), {"__module__": "huggingface_hub.errors"})(f"{status} Client Error")
    e.response = types.SimpleNamespace(status_code=status)
    return e


def chained(outer: Exception, cause: Exception) -> Exception:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize("exc,kind", [
    (OSError(errno.EIO, "Input/output error"), "io"),
    (OSError(errno.ESTALE, "Stale file handle"), "io"),
    (OSError(errno.ECONNRESET, "Connection reset"), "network"),
    (http_error(429), "network"),
    (http_error(503), "network"),
    (chained(ValueError("could not load"), http_error(502)), "network"),
    (RuntimeError("CUDA error: initialization error\nCUDA kernel errors might be asynchronously reported"),
     "cuda_startup"),
    (RuntimeError("No CUDA GPUs are available; CUDA driver initialization failed, you might not have a CUDA gpu."),
     "cuda_startup"),
    (RuntimeError("CUDA error: unspecified launch failure"), "device_lost"),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), "device_lost"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1234"),
     "peer"),
    (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"), "network"),
    (ConnectionError("Couldn't reach 'x/y' on the Hub (LocalEntryNotFoundError)"), "network"),
    (TransientError("device_lost", "gone"), "device_lost"),
])
def test_the_transient_classes(exc, kind):
    assert faults.kind_of(exc) == kind
    assert faults.describe(exc).startswith(faults.KINDS[kind])


@pytest.mark.parametrize("exc", [
    OSError(errno.ENOSPC, "No space left on device"),  # a full disk: a rerun into it fails the same way
    OSError(errno.EACCES, "Permission denied"),
    OSError(errno.ENOENT, "No such file or directory"),
    http_error(404),  # a dataset id that does not exist
    http_error(401),
    ConnectionError("Couldn't reach 'x/y' on the Hub (OfflineModeIsEnabled)"),  # HF_HUB_OFFLINE: a setting
    RuntimeError("CUDA error: device-side assert triggered"),  # the code's
    ValueError("--lr must be > 0"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
])
def test_what_a_rerun_would_repeat_is_not_transient(exc):
    assert faults.kind_of(exc) is None and faults.as_transient(exc) is None


def test_as_transient_keeps_the_message_and_the_agreement():
    e = faults.as_transient(OSError(errno.EIO, "Input/output error"), agreed=True)
    assert isinstance(e, AgreedTransient) and e.kind == "io" and "Input/output error" in str(e)
    import pickle  # DCP and all_gather_object send errors between ranks
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.kind, str(back)) == (AgreedTransient, "io", str(e))


def test_backoff_tries_a_network_error_again_and_gives_up_after_its_pauses():
    calls, slept = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise http_error(429)
        return "ok"

    assert faults.backoff(flaky, "hub", pauses=(1.0, 2.0, 4.0), sleep=slept.append) == "ok"
    assert slept == [1.0, 2.0] and len(calls) == 3
    with pytest.raises(Exception, match="503"):
        faults.backoff(lambda: (_ for _ in ()).throw(http_error(503)), "hub", pauses=(1.0, 1.0), sleep=slept.append)
    assert slept == [1.0, 2.0, 1.0, 1.0]
    with pytest.raises(ValueError):  # not a network error: raised at once, no pause
        faults.backoff(lambda: (_ for _ in ()).throw(ValueError("bad")), "hub", pauses=(1.0,), sleep=slept.append)
    assert len(slept) == 4


def test_a_hub_dataset_that_answers_429_is_retried_then_called_transient_not_a_bad_flag(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from llama_fp8.data import hub

    answers = iter([http_error(429), {"train": "the split"}])

    def load_dataset(*a, **kw):
        got = next(answers)
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(faults.transient, "PAUSES", (0.0,))
    monkeypatch.setattr(faults.transient.backoff, "__defaults__", ((0.0,), faults.transient.time.sleep))
    key = types.SimpleNamespace(dataset="org/corpus", config_name=None, streaming=True, data_files=None,
                                val_data_files=None)
    assert hub.load_hub(key) == {"train": "the split"}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: (_ for _ in ()).throw(http_error(503)))
    with pytest.raises(TransientError) as e:
        hub.load_hub(key)
    assert e.value.kind == "network" and "503" in str(e.value)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: (_ for _ in ()).throw(http_error(404)))
    with pytest.raises(ValueError, match="neither a local path nor a loadable"):
        hub.load_hub(key)
