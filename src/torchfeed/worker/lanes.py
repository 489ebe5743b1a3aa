"""A worker's cache lane: a second, small server that only reads the worker's sample store and
takes notes, so that peers asking for samples never wait for an executor and cannot deadlock.

:func:`torchfeed.cached` datasets (loader/cache.py) ask their peers' lanes for the samples
they keep (:func:`lane_get`) and tell a sample's owner which peer keeps it (:func:`lane_note`);
the trainer learns each worker's lane with :func:`lane_address`. The lane server is started on
first use, with the worker's own options (timeouts, call size, handshakes, reachable-at), and
lives as long as the worker process.
"""

from __future__ import annotations

import threading
from typing import Any

from . import samplestore as store_module
from .samplestore import MISSING

_server: Any = None
_lock = threading.Lock()


def lane_address(dataset) -> str | None:
    """Runs on a worker: the address of its lane (started on first use); None without one."""
    global _server
    settings = store_module.lane()
    if settings is None:
        return None
    with _lock:
        if _server is None:
            from .server import WorkerServer

            _server = WorkerServer(
                settings.host, 0, parallel=2, secret=settings.secret, options=settings.options
            ).start()
        return _server.address


def lane_get(dataset: bytes, keys: list) -> dict:
    """Runs on a lane: the samples of ``keys`` this worker keeps, and for those it only owns,
    its notes (:class:`~torchfeed.worker.samplestore.Elsewhere`: the peer that keeps them)."""
    store = store_module.store
    out: dict = {}
    for k in keys:
        x = store.peek(dataset, k)
        if x is MISSING:
            lane = store.where(dataset, k)
            if lane is not None:
                out[k] = store_module.Elsewhere(lane)
        else:
            out[k] = x
    return out


def lane_note(dataset: bytes, keys: list, lane: str) -> None:
    """Runs on a lane: a peer (at ``lane``) keeps these samples, which this worker owns."""
    for k in keys:
        store_module.store.note(dataset, k, lane)


# These run beside seeded loading and draw no random numbers: the worker must not hand the
# global generators back to "outside" code for them.
_RNG_FREE: tuple[Any, ...] = (lane_address, lane_get, lane_note)
for _fn in _RNG_FREE:
    _fn.manages_rng = True
