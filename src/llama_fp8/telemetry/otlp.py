"""``--otlp_endpoint``: the run's gauges (gauges.py, the same names, values and labels as the Prometheus textfile)
pushed through the OpenTelemetry SDK to an OTLP/HTTP receiver, such as the OpenTelemetry collector that each node of
a SageMaker HyperPod observability stack runs and that writes to Amazon Managed Prometheus (docs/metrics.md).

The SDK's periodic reader exports every ``OTEL_METRIC_EXPORT_INTERVAL`` milliseconds (the SDK's variable; default
60000) on its own thread, and once more at the end. Each gauge is an observable instrument whose callback reads the
latest values; the labels are data-point attributes, so that the collector's Prometheus exporters keep them as
labels. Instrument names are the Prometheus names with no unit set (the unit is in the name), so that a collector
that adds unit suffixes adds nothing. An export that fails (the collector gone) is reported once; the SDK keeps
trying at each interval.
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


def _exporter(url: str):
    """The SDK's OTLP/HTTP exporter, wrapped so that its first failure is reported in our words, once."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

    class Reporting(MetricExporter):
        def __init__(self, inner):
            super().__init__(preferred_temporality=inner._preferred_temporality,
                             preferred_aggregation=inner._preferred_aggregation)
            self.inner, self.failed = inner, False

        def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs):
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
            if result is MetricExportResult.FAILURE and not self.failed:
                self.failed = True
                log.warning("metrics sink otlp: export to %s failed (details above); training goes on and the export "
                            "is retried at each interval without further messages", url)
                # The SDK's exporter logs every failed export: after ours, only its critical messages.
                logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)
            return result

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return self.inner.force_flush(timeout_millis)

        def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
            self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)

    return Reporting(OTLPMetricExporter(endpoint=url))


class OtlpSink(Sink):
    """``reader``: the SDK metric reader to use (a test's ``InMemoryMetricReader``); default: the periodic OTLP one."""

    name = "otlp"

    def __init__(self, endpoint: str | None, board: Board, reader=None):
        try:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            from opentelemetry.sdk.resources import Resource
        except ImportError as e:
            raise ImportError("--otlp_endpoint needs opentelemetry-sdk: pip install 'llama-fp8[otlp]'") from e
        self.board, self._lock = board, threading.Lock()
        if reader is None:
            reader = PeriodicExportingMetricReader(_exporter(endpoint_url(endpoint or "")))
        self.provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "llama-fp8"}))
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
