"""A worker's figures for Prometheus: ``torchfeed worker --metrics-port PORT``.

Nothing here counts anything: :class:`WorkerCollector` reads, at each scrape, what the
worker already keeps for ``torchfeed top`` (:class:`~torchfeed.worker.counters.Counters`,
the process-wide :data:`~torchfeed.worker.counters.served`, the sample cache's figures) and
turns it into metric families named after Prometheus' conventions (base units in the
names, ``_total`` on counters). :class:`MetricsServer` serves a registry over HTTP
(Prometheus text or OpenMetrics, as the scraper asks) from threads it owns and stops, as
many as :mod:`~torchfeed.worker.boundedhttp` allows whatever the peers do.

``prometheus_client`` is imported only here and only when metrics are asked for
(``pip install 'torchfeed[metrics]'``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

from . import boundedhttp
from . import counters as workerstats
from . import samplestore as workercache

log = logging.getLogger("torchfeed.metrics")

PREFIX = "torchfeed_worker_"


def require_client() -> Any:
    """The ``prometheus_client`` module, or ImportError saying how to install it."""
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(
            "Prometheus metrics need the prometheus_client package: pip install 'torchfeed[metrics]' "
            "(or pip install prometheus_client)"
        ) from None
    return prometheus_client


class WorkerCollector:
    """The families of one worker process, read from ``server`` at each scrape.

    ``server`` is what :class:`~torchfeed.worker.server.WorkerServer` offers: ``counters``,
    ``connections()``, ``parallel`` and ``address``.
    """

    def __init__(self, server: Any):
        self.server = server

    def describe(self) -> list:
        return []  # families are only known at collect time; registering must not scrape

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        cache = workercache.figures()
        batches, samples = workerstats.served.read()
        looked = cache["cache_hits"] + cache["cache_misses"]
        values = {
            **self.server.counters.snapshot(self.server),
            **cache,
            "batches": batches,
            "samples": samples,
            "cpu_seconds": _cpu_seconds(),
            "cache_hit_ratio": cache["cache_hits"] / looked if looked else 0.0,
        }
        for kind, name, doc, figure in FAMILIES:
            family = kinds[kind](PREFIX + name, doc, labels=["worker"])
            family.add_metric([self.server.address], values[figure])
            yield family


# The families, in scrape order: (kind, name after PREFIX, help, the figure it reports: a key of
# the worker's STATS, of the sample cache's figures, or one WorkerCollector.collect adds).
FAMILIES = (
    ("counter", "batches", "Batches this worker loaded and collated for loaders", "batches"),
    ("counter", "samples", "Samples in those batches", "samples"),
    ("counter", "requests", "Calls answered (batches, builds, statistics, errors)", "requests"),
    ("counter", "errors", "Calls answered with an error", "errors"),
    (
        "counter",
        "busy_seconds",
        "Seconds the executors spent running calls (divide its rate by torchfeed_worker_executors "
        "for the busy share)",
        "busy_seconds",
    ),
    ("gauge", "executors", "Calls this worker runs at once (--parallel)", "parallel"),
    ("gauge", "queued_requests", "Calls received and waiting for an executor", "queued"),
    ("gauge", "clients", "Authenticated connections", "clients"),
    ("counter", "sent_bytes", "Reply bytes before compression (logical)", "bytes_sent"),
    ("counter", "wire_sent_bytes", "Reply bytes as they left (after compression)", "wire_bytes_sent"),
    ("counter", "cpu_seconds", "CPU time of this worker process (user + system)", "cpu_seconds"),
    ("gauge", "resident_memory_bytes", "Resident memory of this worker process", "rss_bytes"),
    ("gauge", "cache_bytes", "Decoded samples the sample cache holds", "cache_bytes"),
    ("gauge", "cache_budget_bytes", "The sample cache's budget (--cache-size)", "cache_budget"),
    ("gauge", "cache_entries", "Samples the sample cache holds", "cache_entries"),
    ("counter", "cache_hits", "Samples found in the sample cache", "cache_hits"),
    ("counter", "cache_misses", "Samples looked for and not found in the sample cache", "cache_misses"),
    (
        "gauge",
        "cache_hit_ratio",
        "Share of the samples looked for that the cache held, since the worker started (0 before any)",
        "cache_hit_ratio",
    ),
)


def _cpu_seconds() -> float:
    import os

    t = os.times()
    return t.user + t.system


class MetricsServer:
    """A registry served over HTTP on ``host:port`` (port 0: a free one).

    Every path answers the metrics (``/metrics`` by convention). Served by a
    :class:`~torchfeed.worker.boundedhttp.BoundedWSGIServer`: one accepting thread plus at
    most ``max_handlers`` handler threads, at most ``per_source`` connections from one
    source, ``read_timeout`` seconds for a request to arrive; connections beyond the caps
    are answered 503 and closed without a thread. :meth:`close` stops the threads and frees
    the port; it is also a context manager.
    """

    def __init__(
        self,
        registry: Any,
        port: int = 0,
        host: str = "127.0.0.1",
        *,
        max_handlers: int = boundedhttp.MAX_HANDLERS,
        per_source: int = boundedhttp.PER_SOURCE,
        read_timeout: float = boundedhttp.READ_TIMEOUT,
    ):
        client = require_client()
        self.registry = registry
        self._httpd = boundedhttp.BoundedWSGIServer(
            (host, port),
            client.make_wsgi_app(registry),
            max_handlers=max_handlers,
            per_source=per_source,
            read_timeout=read_timeout,
        )
        self._thread: threading.Thread | None = threading.Thread(
            target=self._httpd.serve_forever, name="torchfeed-metrics", daemon=True
        )
        try:
            self._thread.start()
        except BaseException:
            self._httpd.server_close()
            raise
        self.host = host
        self.port = self._httpd.server_address[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}/metrics"

    @property
    def refused(self) -> int:
        """Connections closed at once so far: over a cap, or no thread could be started for them."""
        return self._httpd.refused

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving (idempotent)."""
        if self._thread is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MetricsServer({self.url})"


def serve_worker(server: Any, port: int, host: str = "0.0.0.0") -> MetricsServer:
    """Serve ``server``'s figures (and none of prometheus_client's default collectors)."""
    client = require_client()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(WorkerCollector(server))
    metrics = MetricsServer(registry, port, host)
    log.info("torchfeed worker metrics on %s", metrics.url)
    return metrics


__all__ = ["MetricsServer", "WorkerCollector", "serve_worker"]
