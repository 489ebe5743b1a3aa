"""Is the trainer waiting for data? Live loader and per-worker statistics.

Every :class:`RemoteDataLoader` owns one :class:`Accounting`: the consumer's thread
records how long each ``__next__`` waited for its batch, reader threads record each
batch a worker delivered. Both are O(1) per batch (a few counters and a ring of
``(time, value)`` entries for the last :data:`WINDOW` seconds) under a lock held for
microseconds. :meth:`RemoteDataLoader.stats` turns them into a :class:`LoaderStats`.

Counters persist across passes: ``wait_fraction`` is measured since the current pass
started, ``wait_fraction_30s`` and the rates over the last 30 s (passes included).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from . import events

log = logging.getLogger("torchfeed.stats")

WINDOW = 30.0  # seconds of the sliding window
_STATES = ("serving", "draining", "lost", "reconnecting")


@dataclass
class WorkerStats:
    """What one worker did for this loader."""

    address: str
    state: str  # serving | draining | lost | reconnecting
    samples_per_s: float  # over the last 30 s
    batches: int  # delivered since the loader was made
    samples: int  # the same in samples
    inflight: int  # requests it holds now
    mean_batch_seconds: float | None  # the scheduler's estimate of its time per batch
    requeued: int  # batches it held when it was lost, sent elsewhere
    hedged: int  # overdue batches of it duplicated elsewhere


@dataclass
class LoaderStats:
    """A snapshot of a loader: see :meth:`torchfeed.RemoteDataLoader.stats`."""

    wait_fraction: float  # share of wall time inside __next__ waiting, since the pass started
    wait_fraction_30s: float  # the same over the last 30 s
    samples_per_s: float  # delivered to the trainer, over the last 30 s
    batches: int  # delivered in this pass
    samples: int  # delivered in this pass
    bytes_received: int  # reply bytes received for this loader since it was made
    pass_seconds: float  # since the current pass started
    wait_seconds: float  # waited in __next__ since the loader was made (all passes)
    workers: dict[str, WorkerStats] = field(default_factory=dict)
    advice: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable data (for any logger)."""
        return asdict(self)

    def scalars(self, prefix: str = "torchfeed/") -> dict[str, float]:
        """Flat ``name -> number`` pairs, e.g. for TensorBoard's ``add_scalar``."""
        out = {
            f"{prefix}wait_fraction": self.wait_fraction,
            f"{prefix}wait_fraction_30s": self.wait_fraction_30s,
            f"{prefix}samples_per_s": self.samples_per_s,
            f"{prefix}bytes_received": float(self.bytes_received),
        }
        for address, w in self.workers.items():
            out[f"{prefix}workers/{address}/samples_per_s"] = w.samples_per_s
        return out

    def table(self) -> str:
        """The per-worker table and the advice, as text."""
        head = ["worker", "state", "samples/s", "batches", "inflight", "s/batch", "requeued", "hedged"]
        rows = [
            [
                w.address,
                w.state,
                f"{w.samples_per_s:.1f}",
                str(w.batches),
                str(w.inflight),
                "-" if w.mean_batch_seconds is None else f"{w.mean_batch_seconds:.4f}",
                str(w.requeued),
                str(w.hedged),
            ]
            for w in self.workers.values()
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = ["  ".join(c.ljust(n) for c, n in zip(r, widths)) for r in [head, *rows]]
        lines.append(
            f"trainer: waits {self.wait_fraction:.0%} of the pass ({self.wait_fraction_30s:.0%} over 30 s), "
            f"{self.samples_per_s:.1f} samples/s, {self.batches} batches, {self.bytes_received / 1e6:.1f} MB"
        )
        lines.append(self.advice)
        return "\n".join(lines)


class _Worker:
    __slots__ = ("batches", "samples", "ring", "ring_samples", "spb", "requeued", "hedged", "draining")

    def __init__(self):
        self.batches = 0
        self.samples = 0
        self.ring: deque = deque()  # (time, samples)
        self.ring_samples = 0
        self.spb: float | None = None
        self.requeued = 0
        self.hedged = 0
        self.draining = False


class Accounting:
    """One loader's counters (see the module docstring); thread-safe, O(1) per batch."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.created = clock()
        self._pass_start = self.created
        self._pass_wait = 0.0
        self._total_wait = 0.0
        self._pass_batches = 0
        self._pass_samples = 0
        self._bytes = 0
        self._ring: deque = deque()  # (end time, wait, busy, samples) per delivered batch
        self._w_wait = 0.0
        self._w_busy = 0.0
        self._w_samples = 0
        self._last_exit: float | None = None  # when the consumer last left __next__
        self._entered: float | None = None  # when the consumer entered __next__, while inside
        self._workers: dict[str, _Worker] = {}
        self._inflight = None  # callable -> {address: requests held}, from the running pass
        self.summary_every: float | None = None
        self._next_summary = math.inf

    # -- recording (consumer and reader threads) -------------------------------------------
    def pass_started(self, workers, inflight=None) -> None:
        now = self._clock()
        with self._lock:
            self._pass_start = now
            self._pass_wait = 0.0
            self._pass_batches = 0
            self._pass_samples = 0
            self._last_exit = now
            # weakly: an abandoned pass must still be collected (and closed)
            self._inflight = weakref.WeakMethod(inflight) if inflight is not None else None
            for w in workers:
                if w not in self._workers:
                    self._workers[w] = _Worker()
                self._workers[w].draining = False

    def enter(self) -> float:
        """The consumer enters ``__next__`` (returns the time, for :meth:`consumed`)."""
        now = self._entered = self._clock()
        return now

    def left(self) -> None:
        """The consumer left ``__next__`` without a batch (end of pass, error)."""
        self._entered = None

    def consumed(self, entered: float, samples: int) -> None:
        """The consumer left ``__next__`` with a batch; it entered at ``entered``."""
        now = self._clock()
        wait = now - entered
        with self._lock:
            self._entered = None
            busy = max(entered - self._last_exit, 0.0) if self._last_exit is not None else 0.0
            self._last_exit = now
            self._pass_wait += wait
            self._total_wait += wait
            self._pass_batches += 1
            self._pass_samples += samples
            self._ring.append((now, wait, busy, samples))
            self._w_wait += wait
            self._w_busy += busy
            self._w_samples += samples
            self._trim(now)
            due = now >= self._next_summary
        if due:
            self._summary(now)

    def delivered(self, address: str, samples: int, nbytes: int, seconds_per_batch: float | None) -> None:
        """A worker's batch was accepted (reader thread)."""
        now = self._clock()
        with self._lock:
            w = self._workers.get(address)
            if w is None:
                w = self._workers[address] = _Worker()
            w.batches += 1
            w.samples += samples
            w.ring.append((now, samples))
            w.ring_samples += samples
            if seconds_per_batch:
                w.spb = seconds_per_batch
            self._bytes += nbytes
            _trim_worker(w, now - WINDOW)

    def mean_batch_bytes(self) -> float | None:
        """Mean reply bytes per batch delivered so far (None before the first)."""
        with self._lock:
            batches = sum(w.batches for w in self._workers.values())
            return self._bytes / batches if batches else None

    def requeued(self, address: str, count: int) -> None:
        with self._lock:
            w = self._workers.get(address)
            if w is not None:
                w.requeued += count

    def hedged(self, address: str) -> None:
        """A batch held by ``address`` was duplicated elsewhere."""
        with self._lock:
            w = self._workers.get(address)
            if w is not None:
                w.hedged += 1

    def draining(self, address: str) -> None:
        with self._lock:
            w = self._workers.get(address)
            if w is not None:
                w.draining = True

    def joined(self, address: str) -> None:
        with self._lock:
            w = self._workers.setdefault(address, _Worker())
            w.draining = False

    def _trim(self, now: float) -> None:
        old = now - WINDOW
        ring = self._ring
        while ring and ring[0][0] < old:
            _, wait, busy, samples = ring.popleft()
            self._w_wait -= wait
            self._w_busy -= busy
            self._w_samples -= samples

    # -- reading ---------------------------------------------------------------------------
    def snapshot(self, workers=None) -> LoaderStats:
        now = self._clock()
        inflight = {}
        method = self._inflight() if self._inflight is not None else None
        if method is not None:
            try:
                inflight = method()
            except RuntimeError:  # a worker was added meanwhile: counts are shown as 0 once
                inflight = {}
        with self._lock:
            self._trim(now)
            span = max(min(WINDOW, now - self.created), 1e-9)
            pass_seconds = max(now - self._pass_start, 1e-9)
            # a wait in progress counts too: a trainer stuck in __next__ is input-bound
            entered = self._entered
            pending = max(now - entered, 0.0) if entered is not None else 0.0
            ws = {}
            names = (
                list(self._workers) if workers is None else list(dict.fromkeys([*workers, *self._workers]))
            )
            for address in names:
                w = self._workers.get(address) or _Worker()
                _trim_worker(w, now - WINDOW)
                state = events.state_of(address)
                if state == "serving" and w.draining:
                    state = "draining"
                ws[address] = WorkerStats(
                    address=address,
                    state=state,
                    samples_per_s=w.ring_samples / span,
                    batches=w.batches,
                    samples=w.samples,
                    inflight=inflight.get(address, 0),
                    mean_batch_seconds=w.spb,
                    requeued=w.requeued,
                    hedged=w.hedged,
                )
            out = LoaderStats(
                wait_fraction=min((self._pass_wait + pending) / pass_seconds, 1.0),
                wait_fraction_30s=min((self._w_wait + min(pending, WINDOW)) / span, 1.0),
                samples_per_s=self._w_samples / span,
                batches=self._pass_batches,
                samples=self._pass_samples,
                bytes_received=self._bytes,
                pass_seconds=pass_seconds,
                wait_seconds=self._total_wait + pending,
                workers=ws,
            )
            batches_30s = len(self._ring)
            busy_30s = self._w_busy
        out.advice = advise(out, batches_30s, busy_30s)
        return out

    # -- periodic summary ------------------------------------------------------------------
    def log_every(self, seconds: float | None) -> None:
        self.summary_every = seconds
        self._next_summary = self._clock() + seconds if seconds else math.inf

    def _summary(self, now: float) -> None:
        self._next_summary = now + (self.summary_every or math.inf)
        s = self.snapshot()
        rates = ", ".join(f"{a} {w.samples_per_s:.0f}/s ({w.state})" for a, w in s.workers.items())
        log.info(
            "loader: waits %.0f%% (30 s: %.0f%%), %.1f samples/s; workers: %s; %s",
            100 * s.wait_fraction,
            100 * s.wait_fraction_30s,
            s.samples_per_s,
            rates or "none",
            s.advice,
        )


def _trim_worker(w: _Worker, old: float) -> None:
    ring = w.ring
    while ring and ring[0][0] < old:
        w.ring_samples -= ring.popleft()[1]


INPUT_BOUND = 0.3  # wait fractions above this are called input-bound


def advise(s: LoaderStats, batches: int, busy: float) -> str:
    """One sentence from measured rates: input-bound or not, and how many workers would keep up."""
    wait = s.wait_fraction_30s if batches else s.wait_fraction
    serving = [w for w in s.workers.values() if w.state in ("serving", "draining")]
    now_count = len(serving)
    if batches < 2:
        return "not enough batches yet to tell whether the trainer waits for data"
    if wait <= INPUT_BOUND:
        return f"not input-bound: the trainer waits {wait:.0%} of the time"
    # the trainer could take batches at 1 / (its own time per batch); workers give their measured rates
    own = max(busy / batches, 1e-4)  # below 0.1 ms per batch the trainer does nothing measurable
    per_batch = s.samples / s.batches if s.batches else 1.0
    demand = per_batch / own  # samples/s the trainer would take if it never waited
    rates = [w.samples_per_s for w in serving if w.samples_per_s > 0]
    if not rates:
        return f"input-bound: the trainer waits {wait:.0%} of the time and no worker delivered lately"
    per_worker = sum(rates) / len(rates)
    need = max(math.ceil(demand / per_worker), now_count + 1)
    shown = f"about {need}" if need <= 1000 else "more than 1000"
    return (
        f"input-bound: the trainer waits {wait:.0%} of the time; {shown} workers (now {now_count}) "
        "would keep up"
    )


__all__ = ["Accounting", "LoaderStats", "WorkerStats", "advise", "WINDOW"]
