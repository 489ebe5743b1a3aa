"""Worker membership and loading events: logged under ``torchfeed.*``, kept as worker states.

Lost, joined, drained and reconnected workers, hedged batches and poison samples are
events, not warnings (the user has nothing to change in code). They may be noticed on a
connection's reader thread with a pass lock held, so :func:`record` only appends to a
queue and sets the worker's state (O(1), no I/O); :func:`flush` writes the queued lines
to :mod:`logging` from a thread that may block (the trainer's ``__next__``, the
membership thread). Each kind of event logs at most :data:`BURST` lines per
:data:`PERIOD` seconds; the lines left out are counted in one line when the period
ended (at the next flush, or at exit). At most :data:`MAX_QUEUED` events wait between
two flushes; the others are only counted. The library never prints.

Worker states (``serving``, ``draining``, ``lost``, ``reconnecting``) are per address
and per process: every loader of this process sees the same state of a worker.
"""

from __future__ import annotations

import atexit
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
    "closed": ("torchfeed.workers", logging.INFO),
    "hedged": ("torchfeed.hedging", logging.INFO),
    "poison": ("torchfeed.poison", logging.ERROR),
}
BURST = 5  # lines per kind of event per period, at most
PERIOD = 10.0  # seconds
MAX_QUEUED = 1000  # events queued between two flushes, at most (the others are only counted)

_queue: deque = deque()  # (kind, message)
_states: dict[str, str] = {}  # address -> serving | draining | lost | reconnecting
_lock = threading.Lock()  # taken by flush only (one flusher at a time)
_budget: dict[str, list] = {}  # kind -> [period start, lines logged, lines left out]
_refused: dict[str, int] = {}  # kind -> events not queued (the queue was full)
_owed = False  # whether some kind has lines left out not reported yet


def record(kind: str, message: str, address: str | None = None, state: str | None = None) -> None:
    """Note an event (any thread, any lock held): queued for :func:`flush`, state set at once."""
    if address is not None and state is not None:
        _states[address] = state
    if len(_queue) >= MAX_QUEUED:  # nobody flushes for now: count, do not grow
        _refused[kind] = _refused.get(kind, 0) + 1
        return
    _queue.append((kind, message))


def pending() -> int:
    """Events queued for the next :func:`flush` (at most :data:`MAX_QUEUED`)."""
    return len(_queue)


def set_state(address: str, state: str) -> None:
    _states[address] = state


def states() -> dict[str, str]:
    """Every worker's state by address (read it, do not change it): :func:`state_of` for many."""
    return _states


def state_of(address: str) -> str:
    """The worker's state as this process last saw it (``serving`` when nothing happened)."""
    return _states.get(address, "serving")


def flush(final: bool = False) -> None:
    """Log the queued events (rate-limited per kind); call from a thread that may block.

    The lines a kind left out are reported in one line at the first flush after its period
    ended, or at once when ``final`` (interpreter exit)."""
    global _owed
    if not (_queue or _owed or _refused or final):
        return
    if not _lock.acquire(blocking=False):
        return  # another thread is flushing
    try:
        now = time.monotonic()
        while _refused:
            try:
                kind, count = _refused.popitem()
            except KeyError:
                break
            _budget.setdefault(kind, [now, 0, 0])[2] += count
        while _queue:
            try:
                kind, message = _queue.popleft()
            except IndexError:
                break
            budget = _budget.setdefault(kind, [now, 0, 0])
            if now - budget[0] > PERIOD:
                _new_period(kind, budget, now)
            if budget[1] >= BURST:
                budget[2] += 1
                continue
            budget[1] += 1
            name, level = LOGGERS.get(kind, ("torchfeed", logging.INFO))
            logging.getLogger(name).log(level, message)
        for kind, budget in _budget.items():
            if budget[2] and (final or now - budget[0] > PERIOD):
                _new_period(kind, budget, now)
        _owed = any(budget[2] for budget in _budget.values())
    finally:
        _lock.release()


def new_periods() -> None:
    """Start every kind's period now, after logging what is queued and reporting the lines
    left out so far (a test that counts lines starts from a full budget this way)."""
    flush()
    with _lock:
        now = time.monotonic()
        for kind, budget in _budget.items():
            _new_period(kind, budget, now)


def _new_period(kind: str, budget: list, now: float) -> None:
    """Report the lines ``kind`` left out in its period (if any) and start a new one (lock held)."""
    if budget[2]:
        name, level = LOGGERS.get(kind, ("torchfeed", logging.INFO))
        logging.getLogger(name).log(
            level,
            "%d more '%s' event(s) were not logged (at most %d lines per %g s are)",
            budget[2],
            kind,
            BURST,
            PERIOD,
        )
    budget[:] = [now, 0, 0]


# the lines still left out are reported at exit (before logging's own shutdown, registered earlier)
atexit.register(flush, True)


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


def closed(address: str) -> None:
    record("closed", f"connection to worker {address} closed by this process")


def batch_hedged(seq: int, slow: str, address: str) -> None:
    record("hedged", f"batch {seq} on {slow} is overdue; duplicating it on {address}")


def poison(message: str) -> None:
    record("poison", message)


__all__ = ["record", "flush", "pending", "state_of", "states", "set_state"]
