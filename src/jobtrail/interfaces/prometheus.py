"""``worker --metrics-port``: jobtrail's metrics on a Prometheus scrape endpoint (the ``otel`` extra).

The OpenTelemetry SDK's Prometheus reader turns the instruments into Prometheus metrics at each
scrape, on the scrape's thread (so the ledger gauges' queries never run on the event loop).
"""

from __future__ import annotations

from typing import Any

from jobtrail.domain.errors import ConfigError, require_extra


def serve_metrics(host: str, port: int) -> Any:
    """Serve ``GET /metrics`` on ``host:port`` from a thread; returns the server (``shutdown()`` stops it)."""
    require_extra(
        "otel", "--metrics-port", "opentelemetry.sdk.metrics", "opentelemetry.exporter.prometheus", "prometheus_client"
    )
    from opentelemetry import metrics
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import start_http_server

    if isinstance(metrics.get_meter_provider(), MeterProvider):
        raise ConfigError(
            "an OpenTelemetry meter provider is already configured (opentelemetry-instrument?): export "
            "Prometheus metrics through it (OTEL_METRICS_EXPORTER=prometheus) and drop --metrics-port"
        )
    metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc}; choose another --metrics-port") from exc
    return server
