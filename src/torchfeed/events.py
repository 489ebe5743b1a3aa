"""Worker membership and loading events: logged under ``torchfeed.*``, kept as worker states.

Lost, joined, drained and reconnected workers, hedged batches and poison samples are
events, not warnings (the user has nothing to change in code). They may be noticed on a
connection's reader thread with a pass lock held, so :func:`record` only appends to a
queue and sets the worker's state (O(1), no I/O); :func:`flush` writes the queued lines
to :mod:`logging` from a thread that may block (the trainer's ``__next__``, the
membership thread). Each kind of event logs at most :data:`BURST` lines per
:data:`PERIOD` seconds; the lines left out are counted in the next one. The library
never prints.

Worker states (``serving``, ``draining``, ``lost``, ``reconnecting``) are per address
and per process: every loader of this process sees the same state of a worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

LOGGERS = {
    "lost": ("torchfeed.workers", logging.WARNING),
    "unreachable": ("torchfeed.workers", logging.WARNING),
    "no_worker": ("torchfeed.workers", logging.WARNING),
    "joined": ("torchfeed.workers", logging.INFO),
    "reconnecting": ("torchfeed.workers", logging.INFO),
    "reconnected": ("torchfeed.workers", logging.WARNING),
    "drained": ("torchfeed.workers", logging.INFO),
    "hedged": ("torchfeed.hedging", logging.INFO),
    "poison": ("torchfeed.poison", logging.ERROR),
}
BURST = 5  # lines per kind of event per period, at most
PERIOD = 10.0  # seconds

_queue: deque = deque()  # (kind, message)
_states: dict[str, str] = {}  # address -> serving | draining | lost | reconnecting
_lock = threading.Lock()  # taken by flush only (one flusher at a time)
_budget: dict[str, list] = {}  # kind -> [period start, lines logged, lines left out]


def record(kind: str, message: str, address: str | None = None, state: str | None = None) -> None:
    """Note an event (any thread, any lock held): queued for :func:`flush`, state set at once."""
    if address is not None and state is not None:
        _states[address] = state
    _queue.append((kind, message))


def set_state(address: str, state: str) -> None:
    _states[address] = state


def state_of(address: str) -> str:
    """The worker's state as this process last saw it (``serving`` when nothing happened)."""
    return _states.get(address, "serving")


def flush() -> None:
    """Log the queued events (rate-limited per kind); call from a thread that may block."""
    if not _queue:
        return
    if not _lock.acquire(blocking=False):
        return  # another thread is flushing
    try:
        now = time.monotonic()
        while _queue:
            try:
                kind, message = _queue.popleft()
            except IndexError:
                break
            name, level = LOGGERS.get(kind, ("torchfeed", logging.INFO))
            budget = _budget.setdefault(kind, [now, 0, 0])
            if now - budget[0] > PERIOD:
                if budget[2]:
                    message = (
                        f"{message} ({budget[2]} more such event(s) not logged in the last {PERIOD:g} s)"
                    )
                budget[:] = [now, 0, 0]
            if budget[1] >= BURST:
                budget[2] += 1
                continue
            budget[1] += 1
            logging.getLogger(name).log(level, message)
    finally:
        _lock.release()


# -- the events, with their wording --------------------------------------------------------
def worker_lost(address: str, error: BaseException | str, requeued: int = 0) -> None:
    record(
        "lost",
        f"lost worker {address} ({error}); its {requeued} batch(es) go to the other workers",
        address,
        "lost",
    )


def worker_unreachable(address: str, error: BaseException | str) -> None:
    record("unreachable", f"worker {address} is unreachable and is skipped for now: {error}", address, "lost")


def no_worker_left(lost: str, wait: float) -> None:
    record(
        "no_worker",
        f"no worker is left to load from (lost: {lost}); waiting up to {wait:g} s (the loader's "
        "timeout) for one to come back or join, then WorkerLost is raised",
    )


def worker_joined(address: str) -> None:
    was = _states.get(address)
    if was in ("lost", "reconnecting"):
        record("reconnected", f"worker {address} is back; the dataset was rebuilt there", address, "serving")
    else:
        record("joined", f"worker {address} joined", address, "serving")


def worker_reconnecting(address: str) -> None:
    record(
        "reconnecting",
        f"worker {address} answers again; rebuilding the dataset there",
        address,
        "reconnecting",
    )


def worker_drained(address: str) -> None:
    record("drained", f"worker {address} was removed; its batches in flight finish", address, "draining")


def batch_hedged(seq: int, slow: str, address: str) -> None:
    record("hedged", f"batch {seq} on {slow} is overdue; duplicating it on {address}")


def poison(message: str) -> None:
    record("poison", message)


__all__ = ["record", "flush", "state_of", "set_state"]
