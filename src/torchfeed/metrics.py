"""A trainer's loaders for Prometheus: :func:`serve` and :class:`LoaderCollector`.

Nothing here counts anything: at each scrape :class:`LoaderCollector` takes one
:meth:`RemoteDataLoader.stats` snapshot (cheap: fixed memory, microseconds under a lock)
and turns it into metric families named after Prometheus' conventions (base units in the
names, ``_total`` on counters, a ``loader`` label, and a ``worker`` label on the
per-worker families). The worker count the autoscale policy would ask for
(:meth:`torchfeed.scaling.Policy.need` over the snapshot's rates) is exported as
``torchfeed_loader_advised_workers``, so Kubernetes' own autoscalers (an HPA on an
external metric, KEDA) can size a worker Deployment the way :func:`torchfeed.autoscale`
sizes a pool.

The workers' own figures come from ``torchfeed worker --metrics-port PORT``
(:mod:`torchfeed.worker.prometheus`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping
from typing import Any

from .scaling import Policy, Reading
from .stats import INPUT_BOUND, LINK_BOUND, LoaderStats
from .worker.prometheus import MetricsServer, require_client

PREFIX = "torchfeed_loader_"
_STATES = ("serving", "draining", "lost", "reconnecting")
_MIN_BUSY = 0.01  # below this share of busy time the trainer's demand is unknown (taken as 100x the rate)


def demand(s: LoaderStats) -> float | None:
    """Samples/s the trainer would take if it never waited (None before it took any)."""
    if s.samples_per_s <= 0:
        return None
    return s.samples_per_s / max(1.0 - s.wait_fraction_30s, _MIN_BUSY)


def per_worker(s: LoaderStats) -> float | None:
    """Samples/s one serving worker delivers at full speed: the median of their measured
    capacities (samples per batch over seconds per batch) or rates, the larger one."""
    serving = [w for w in s.workers.values() if w.state == "serving"]
    capacity = [
        w.samples / w.batches / w.mean_batch_seconds for w in serving if w.mean_batch_seconds and w.batches
    ]
    rates = [w.samples_per_s for w in serving if w.samples_per_s > 0]
    best = max(statistics.median(capacity) if capacity else 0.0, statistics.median(rates) if rates else 0.0)
    return best or None


def advised_workers(s: LoaderStats, policy: Policy | None = None) -> int:
    """Workers that would keep up with the trainer, within ``policy``'s bounds (its headroom
    too); the serving count while nothing is measured yet (an autoscaler then keeps the size)."""
    policy = policy if policy is not None else Policy()
    serving = sum(1 for w in s.workers.values() if w.state == "serving")
    reading = Reading(
        time=0.0,
        workers=serving,
        requested=serving,
        wait=s.wait_fraction_30s,
        demand=demand(s),
        per_worker=per_worker(s),
        active=s.samples_per_s > 0,
    )
    need = policy.need(reading)
    return policy.clamp(serving if need is None else need)


class LoaderCollector:
    """Families of one loader (label ``loader=name``), read at each scrape.

    ``policy``: the :class:`torchfeed.scaling.Policy` whose bounds and headroom the advised
    worker count follows (the defaults of :func:`torchfeed.autoscale` when None).
    """

    def __init__(self, loader: Any, name: str = "train", policy: Policy | None = None):
        if not callable(getattr(loader, "stats", None)):
            raise TypeError(
                f"LoaderCollector needs a RemoteDataLoader (with stats()), got {type(loader).__name__}"
            )
        self.loader = loader
        self.name = name
        self.policy = policy

    def describe(self) -> list:
        return []  # families are only known at collect time; registering must not scrape

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s: LoaderStats = self.loader.stats()
        me = [self.name]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[GaugeMetricFamily]:
            if value is None:
                return  # not measured yet: no sample rather than a made-up one
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["loader"])
            family.add_metric(me, value)
            yield family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["loader"])
            family.add_metric(me, value)
            return family

        yield from gauge(
            "wait_ratio", "Share of the trainer's time spent waiting for data, last 30 s", s.wait_fraction_30s
        )
        yield from gauge(
            "pass_wait_ratio", "Share of the current pass spent waiting for data", s.wait_fraction
        )
        yield counter("wait_seconds", "Seconds the trainer waited for data in __next__", s.wait_seconds)
        yield from gauge(
            "samples_per_second", "Samples delivered to the trainer per second, last 30 s", s.samples_per_s
        )
        yield from gauge(
            "demand_samples_per_second",
            "Samples per second the trainer would take if it never waited",
            demand(s),
        )
        yield from gauge(
            "advised_workers",
            "Workers that would keep up with the trainer (the autoscale policy's need, within its bounds)",
            advised_workers(s, self.policy),
        )
        wait = s.wait_fraction_30s
        yield from gauge(
            "input_bound",
            "1 when the trainer waits for data more than 30% of the time",
            float(wait > INPUT_BOUND),
        )
        yield from gauge(
            "link_bound",
            "1 when the trainer is input-bound and the replies spend most of the time arriving "
            "(more workers will not help)",
            float(wait > INPUT_BOUND and s.link_busy >= LINK_BOUND),
        )
        yield from gauge(
            "link_busy_ratio", "Share of the last 30 s the workers' replies spent arriving", s.link_busy
        )
        yield counter(
            "received_bytes", "Reply bytes received (logical, after decompression)", s.bytes_received
        )
        yield counter("wire_received_bytes", "Reply bytes as they crossed the network", s.wire_bytes_received)
        yield from gauge("pass_batches", "Batches delivered in the current pass", s.batches)
        yield from gauge(
            "cache_hit_ratio",
            "Share of this pass's samples found in the pool's sample cache",
            s.cache_hit_rate,
        )
        states = GaugeMetricFamily(
            PREFIX + "workers", "Workers of this loader by state", labels=["loader", "state"]
        )
        for state in _STATES:
            states.add_metric([self.name, state], sum(1 for w in s.workers.values() if w.state == state))
        yield states
        yield from self._per_worker(s)

    def _per_worker(self, s: LoaderStats) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for attribute, counts, name, text in _PER_WORKER:
            kind = CounterMetricFamily if counts else GaugeMetricFamily
            family = kind(PREFIX + name, text, labels=["loader", "worker"])
            for address, w in s.workers.items():
                value = getattr(w, attribute)
                if value is not None:  # a worker's batch time is unknown before its first batch
                    family.add_metric([self.name, address], value)
            yield family


# per-worker figures: (WorkerStats attribute, a counter (else a gauge), metric name, its help)
_PER_WORKER = [
    ("batches", True, "worker_batches", "Batches this worker delivered"),
    ("samples", True, "worker_samples", "Samples this worker delivered"),
    ("samples_per_s", False, "worker_samples_per_second", "Samples per second it delivered, last 30 s"),
    ("inflight", False, "worker_inflight_batches", "Batches it holds now"),
    ("requeued", True, "worker_requeued_batches", "Batches it held when lost, sent elsewhere"),
    ("hedged", True, "worker_hedged_batches", "Overdue batches of it duplicated elsewhere"),
    (
        "mean_batch_seconds",
        False,
        "worker_batch_seconds",
        "The scheduler's estimate of its seconds per batch",
    ),
]


def registry(loaders: Any, policy: Policy | None = None) -> Any:
    """A ``prometheus_client`` registry holding a collector per loader (``loaders``: one loader,
    named ``train``, or a mapping ``name -> loader``)."""
    client = require_client()
    named = dict(loaders) if isinstance(loaders, Mapping) else {"train": loaders}
    if not named:
        raise ValueError("serve() needs at least one loader")
    reg = client.CollectorRegistry(auto_describe=False)
    for name, loader in named.items():
        reg.register(LoaderCollector(loader, name, policy))
    return reg


def serve(
    loaders: Any, port: int = 0, host: str = "127.0.0.1", *, policy: Policy | None = None
) -> MetricsServer:
    """Serve the figures of ``loaders`` to Prometheus on ``host:port`` (HTTP, ``/metrics``).

    ``loaders``: a :class:`~torchfeed.RemoteDataLoader` (label ``loader="train"``) or a
    mapping ``name -> loader``. ``port`` 0 picks a free one (see the returned server's
    ``port`` and ``url``); ``host`` ``"0.0.0.0"`` lets Prometheus scrape from other machines.
    ``policy``: the bounds and headroom of the advised worker count. Returns a
    :class:`~torchfeed.worker.prometheus.MetricsServer`: ``close()`` it, or use it in ``with``.
    It holds at most 9 threads however many connections arrive (see
    :mod:`torchfeed.worker.boundedhttp`), so a flood of them cannot take the threads the
    loader needs.
    """
    return MetricsServer(registry(loaders, policy), port, host)


__all__ = ["LoaderCollector", "MetricsServer", "advised_workers", "demand", "per_worker", "registry", "serve"]
