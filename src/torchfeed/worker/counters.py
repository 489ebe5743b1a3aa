"""Worker-side statistics: what ``torchfeed top`` shows, answered without running user code.

A worker keeps a few counters (:class:`Counters`: requests answered, reply bytes, errors),
updated by its executor threads under a lock held for a few instructions. A STATS message
(authenticated like every other message) is answered by the connection's reader thread
from those counters and the process's own numbers (CPU time from ``os.times``, resident
memory from ``/proc/self/statm``); the reply is sent like any other (``send`` never
blocks), so nothing holds the reader up. :func:`query` is the client side.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from typing import Any

from ..protocol import wire
from . import samplestore as workercache

_RATE_SECONDS = 0.9  # rates are measured over the last 1 to 2 seconds (the keeper ticks every second)


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def rss_bytes() -> int:
    """Resident memory of this process."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the peak, where statm is missing


class Counters:
    """A worker process's counters (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.requests = 0
        self.bytes_sent = 0
        self.wire_bytes_sent = 0  # the same after compression (protocol.codec)
        self.errors = 0
        self.busy_seconds = 0.0  # executor time spent running calls (all executors together)
        sample = (self.started, _cpu_seconds(), 0, 0, 0)
        self._older = self._newer = sample  # (time, cpu seconds, requests, bytes, wire bytes) for the rates

    def replied(self, kind: int, meta: bytes, buffers, wire_bytes: int | None = None) -> None:
        """Count a reply: its bytes, and ``wire_bytes`` when its buffers travel compressed."""
        size = len(meta) + sum(memoryview(b).nbytes for b in buffers)
        with self._lock:
            self.requests += 1
            self.bytes_sent += size
            self.wire_bytes_sent += size if wire_bytes is None else len(meta) + wire_bytes
            if kind == wire.ERROR:
                self.errors += 1

    def ran(self, seconds: float) -> None:
        """An executor spent ``seconds`` running one call."""
        with self._lock:
            self.busy_seconds += seconds

    def refused(self) -> None:
        with self._lock:
            self.requests += 1
            self.errors += 1

    def tick(self) -> None:
        """Take a sample for the rates (the worker's keeper thread, about every second)."""
        now, cpu = time.monotonic(), _cpu_seconds()
        with self._lock:
            if now - self._newer[0] >= _RATE_SECONDS:
                sample = (now, cpu, self.requests, self.bytes_sent, self.wire_bytes_sent)
                self._older, self._newer = self._newer, sample

    def snapshot(self, server) -> dict[str, Any]:
        """Plain data: the process's CPU%, memory, rates (over the last 1-2 s) and load."""
        now, cpu = time.monotonic(), _cpu_seconds()
        with self._lock:
            requests, sent, wired, errors = self.requests, self.bytes_sent, self.wire_bytes_sent, self.errors
            busy = self.busy_seconds
            t0, cpu0, req0, sent0, wired0 = self._older
        span = max(now - t0, 1e-6)
        conns = server.connections()
        return {
            "address": server.address,
            "pid": os.getpid(),
            "cpu_percent": 100.0 * (cpu - cpu0) / span,
            "rss_bytes": rss_bytes(),
            "requests_per_s": (requests - req0) / span,
            "mb_per_s_sent": (sent - sent0) / span / 1e6,
            "wire_mb_per_s_sent": (wired - wired0) / span / 1e6,  # after compression
            "clients": len(conns),
            "queued": sum(c.queued for c in conns),
            "errors": errors,
            "requests": requests,
            "bytes_sent": sent,
            "wire_bytes_sent": wired,
            "parallel": server.parallel,
            "uptime_s": now - self.started,
            "busy_seconds": busy,
            **workercache.figures(),  # [cache] decoded samples kept for torchfeed.cached datasets
        }


class Served:
    """Batches and samples this process's fetchers loaded (process-wide: every fetcher of
    every connection counts here; read by the worker's metrics)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.batches = 0
        self.samples = 0

    def add(self, samples: int) -> None:
        with self._lock:
            self.batches += 1
            self.samples += samples

    def read(self) -> tuple[int, int]:
        """(batches, samples) so far."""
        with self._lock:
            return self.batches, self.samples


served = Served()  # this process's


def reply(server) -> bytes:
    """The meta of a STATS reply (JSON, read by :func:`torchfeed.client.worker_stats`)."""
    return json.dumps(server.counters.snapshot(server)).encode()
