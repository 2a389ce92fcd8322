"""``--otlp_endpoint``: the run's gauges (gauges.py, the same names, values and labels as the Prometheus textfile)
pushed through the OpenTelemetry SDK to an OTLP/HTTP receiver, such as the OpenTelemetry collector that each node of
a SageMaker HyperPod observability stack runs and that writes to Amazon Managed Prometheus (docs/metrics.md).

The SDK's periodic reader exports every ``OTEL_METRIC_EXPORT_INTERVAL`` milliseconds (the SDK's variable; default
60000) on its own thread, and once more at the end. Each gauge is an observable instrument whose callback reads the
latest values; the labels are data-point attributes, so that the collector's Prometheus exporters keep them as
labels. Instrument names are the Prometheus names with no unit set (the unit is in the name), so that a collector
that adds unit suffixes adds nothing. An export that fails (the collector gone) is reported once per job, by rank 0,
with the exporter's own message as the cause (its log lines are kept out); the SDK keeps trying at each interval. The
resource honours the standard environment (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``).
"""

from __future__ import annotations

import logging
import threading
from urllib.parse import urlsplit

from llama_fp8.telemetry.gauges import GAUGES, Board
from llama_fp8.telemetry.sinks import Sink

log = logging.getLogger("llama_fp8.metrics")
METRICS_PATH = "/v1/metrics"


def endpoint_url(value: str) -> str:
    """The OTLP/HTTP metrics URL for ``--otlp_endpoint``: ``http(s)://host:port`` gets OTLP's ``/v1/metrics`` path, a
    URL with a path is used as it is. Raises ValueError naming the flag."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp_endpoint {value!r}: give the http(s) URL of an OTLP/HTTP receiver, e.g. "
                         f"http://localhost:4318 (an OpenTelemetry collector's OTLP HTTP port)")
    return value.rstrip("/") + METRICS_PATH if parts.path in ("", "/") else value


class _LastMessage(logging.Handler):
    """Keeps the OTLP exporter's own log lines out of the run's output, and the last one as the failure's cause."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.last = record.getMessage().splitlines()[0][:300] if record.getMessage() else ""


def _exporter(url: str, report: bool):
    """The SDK's OTLP/HTTP exporter, wrapped so that a failure is reported in our words, once per job (``report``: this
    rank reports; the others stay quiet), with the exporter's own message as the cause and its lines kept out."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    quiet = logging.getLogger("opentelemetry.exporter")
    caught = next((h for h in quiet.handlers if isinstance(h, _LastMessage)), None) or _LastMessage()
    if caught not in quiet.handlers:
        quiet.addHandler(caught)
    quiet.propagate = False  # the exporter's retries and failures: caught above, never printed

    class Reporting(MetricExporter):
        def __init__(self, inner):
            super().__init__(preferred_temporality=inner._preferred_temporality,
                             preferred_aggregation=inner._preferred_aggregation)
            self.inner, self.failed = inner, False

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            if result is MetricExportResult.FAILURE and not self.failed:
                self.failed = True
                if report:
                    log.warning("metrics sink otlp: export to %s failed (%s); training goes on and every rank's export "
                                "is retried at each interval without further messages", url,
                                caught.last or "no reason given")
            return result

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return self.inner.force_flush(timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
            self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    return Reporting(OTLPMetricExporter(endpoint=url))


def resource():
    """The SDK resource: the standard OpenTelemetry environment (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) as the
    user set it; ``service.name`` llama-fp8 only where neither names a service."""
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    named = OTELResourceDetector().detect().attributes.get("service.name")
    return Resource.create({} if named else {"service.name": "llama-fp8"})


class OtlpSink(Sink):
    """``reader``: the SDK metric reader to use (a test's ``InMemoryMetricReader``); default: the periodic OTLP one."""

    name = "otlp"

    def __init__(self, endpoint: str | None, board: Board, reader=None):
        try:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        except ImportError as e:
            raise ImportError("--otlp_endpoint needs opentelemetry-sdk: pip install 'llama-fp8[otlp]'") from e
        self.board, self._lock = board, threading.Lock()
        if reader is None:
            reader = PeriodicExportingMetricReader(_exporter(endpoint_url(endpoint or ""), report=board.is_main))
        self.provider = MeterProvider(metric_readers=[reader], resource=resource())
        meter = self.provider.get_meter("llama_fp8")
        for gauge in GAUGES:
            make = meter.create_observable_counter if gauge.counter else meter.create_observable_gauge
            make(gauge.name, callbacks=[self._observe(gauge.name)], description=gauge.help)

    def _observe(self, name: str):
        from opentelemetry.metrics import Observation

        def callback(options):
            with self._lock:  # the reader's thread reads what the training thread writes
                found = [samples for gauge, samples in self.board.samples() if gauge.name == name]
            return [Observation(value, labels) for samples in found for labels, value in samples]
        return callback

    def write(self, rec: dict, line: str | None = None) -> None:
        with self._lock:
            self.board.update(rec)

    def close(self, ended: str) -> None:
        """The last export, then the SDK's threads end."""
        self.provider.shutdown()
