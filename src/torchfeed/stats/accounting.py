"""A loader's counters: what :meth:`RemoteDataLoader.stats` reads, kept in fixed memory.

Every :class:`RemoteDataLoader` owns one :class:`Accounting`: the consumer's thread
records how long each ``__next__`` waited for its batch, reader threads record each
batch a worker delivered. Both are O(1) per batch (a few counters and one-second buckets
covering the last :data:`WINDOW` seconds: fixed memory at any batch rate) under a lock
held for microseconds. :meth:`Accounting.snapshot` turns them into a
:class:`~torchfeed.stats.LoaderStats` (:mod:`torchfeed.stats.report`).

Counters persist across passes: ``wait_fraction`` is measured over the current (or last)
pass, ``wait_fraction_30s`` and the rates over the last 30 s, counting only the time the
trainer spent in a pass: idle time before the first ``iter()`` or between passes
(validation) does not dilute them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from typing import Any

from .. import events
from .report import LoaderStats, WorkerStats, advise

log = logging.getLogger("torchfeed.stats")

WINDOW = 30.0  # seconds of the sliding window
_SLOTS = int(WINDOW)  # one-second buckets: the window is the last 29 to 30 seconds


class _Worker:
    __slots__ = (
        "batches",
        "samples",
        "sec",
        "slots",
        "recent",
        "arriving",
        "arriving_recent",
        "spb",
        "requeued",
        "hedged",
        "draining",
    )

    def __init__(self):
        self.batches = 0
        self.samples = 0
        self.sec = -1  # the newest second with a slot in use
        self.slots = [0] * _SLOTS  # samples delivered per second, for the last _SLOTS seconds
        self.recent = 0  # their sum
        self.arriving = [0.0] * _SLOTS  # seconds its replies spent arriving (header to last byte), per second
        self.arriving_recent = 0.0  # their sum
        self.spb: float | None = None
        self.requeued = 0
        self.hedged = 0
        self.draining = False

    def advance(self, sec: int) -> None:
        """Forget the seconds that left the window (O(1) amortized: each slot is cleared once)."""
        last = self.sec
        if sec <= last:
            return
        if sec - last >= _SLOTS:
            self.slots = [0] * _SLOTS
            self.recent = 0
            self.arriving = [0.0] * _SLOTS
            self.arriving_recent = 0.0
        else:
            slots, arriving = self.slots, self.arriving
            for s in range(last + 1, sec + 1):
                i = s % _SLOTS
                self.recent -= slots[i]
                slots[i] = 0
                self.arriving_recent -= arriving[i]
                arriving[i] = 0.0
        self.sec = sec


class _Buckets:
    """The trainer's side per second of the window: wait, busy, samples and batches (fixed memory)."""

    __slots__ = ("sec", "slots", "totals")

    def __init__(self):
        self.sec = -1
        self.slots = [[0.0, 0.0, 0, 0] for _ in range(_SLOTS)]
        self.totals: list = [0.0, 0.0, 0, 0]  # sums of the slots

    def advance(self, sec: int) -> None:
        last = self.sec
        if sec <= last:
            return
        if sec - last >= _SLOTS:
            self.slots = [[0.0, 0.0, 0, 0] for _ in range(_SLOTS)]
            self.totals = [0.0, 0.0, 0, 0]
        else:
            totals = self.totals
            for s in range(last + 1, sec + 1):
                slot = self.slots[s % _SLOTS]
                for k in range(4):
                    totals[k] -= slot[k]
                slot[:] = [0.0, 0.0, 0, 0]
        self.sec = sec

    def add(self, sec: int, wait: float, busy: float, samples: int, batches: int) -> None:
        self.advance(sec)
        slot, totals = self.slots[sec % _SLOTS], self.totals
        slot[0] += wait
        slot[1] += busy
        slot[2] += samples
        slot[3] += batches
        totals[0] += wait
        totals[1] += busy
        totals[2] += samples
        totals[3] += batches


class Accounting:
    """One loader's counters (see the module docstring); thread-safe, O(1) time and memory per batch."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self.created = clock()
        self._pass = 0  # the current pass's number (pass_ended of an older one is ignored)
        self._running = False  # between pass_started and pass_ended
        self._pass_start = self._pass_end = self.created
        self._pass_wait = 0.0
        self._total_wait = 0.0
        self._pass_batches = 0
        self._pass_samples = 0
        self._bytes = 0
        self._wire = 0  # the same on the wire
        self._float_images = False
        self._looked = -1  # the pass whose first batch inspect() looked at
        self._sized = 0  # batches whose reply size is known (the mean of those is mean_batch_bytes)
        self._window = _Buckets()
        self._last_exit: float | None = None  # when the consumer last left __next__
        self._entered: float | None = None  # when the consumer entered __next__, while inside
        self._workers: dict[str, _Worker] = {}
        self._inflight = None  # callable -> {address: requests held}, from the running pass
        self.summary_every: float | None = None
        self._next_summary = math.inf

    # -- recording (consumer and reader threads) -------------------------------------------
    def pass_started(self, workers, inflight=None) -> int:
        """A pass starts with ``workers``; returns its number, for :meth:`pass_ended`."""
        now = self._clock()
        with self._lock:
            self._pass += 1
            self._running = True
            self._pass_start = now
            self._pass_end = None
            self._pass_wait = 0.0
            self._pass_batches = 0
            self._pass_samples = 0
            self._last_exit = now
            self._entered = None
            # weakly: an abandoned pass must still be collected (and closed)
            self._inflight = weakref.WeakMethod(inflight) if inflight is not None else None
            workers = dict.fromkeys(workers)  # in order, for the table's rows
            for address in [a for a, w in self._workers.items() if w.draining and a not in workers]:
                del self._workers[address]  # removed before this pass: drained by now
            for address in workers:
                w = self._workers.get(address)
                if w is None:
                    w = self._workers[address] = _Worker()
                w.draining = False
            return self._pass

    def pass_ended(self, number: int | None = None) -> None:
        """The pass ``number`` (the current one when None) ended: ``pass_seconds`` stops there and
        the time until the next pass is not counted as the trainer's."""
        now = self._clock()
        with self._lock:
            if not self._running or (number is not None and number != self._pass):
                return
            self._running = False
            self._pass_end = now

    def inspect(self, batch: Any) -> None:
        """The consumer's first batch of a pass: does it hold float32 images (for the advice)?"""
        if self._looked == self._pass:
            return
        self._looked = self._pass
        values = (
            batch.values()
            if isinstance(batch, dict)
            else batch
            if isinstance(batch, (list, tuple))
            else [batch]
        )
        self._float_images = any(
            getattr(v, "dtype", None) is not None
            and str(v.dtype) == "torch.float32"
            and getattr(v, "ndim", 0) == 4
            and v.shape[1] in (1, 3, 4)
            for v in list(values)[:16]
        )

    def enter(self) -> float:
        """The consumer enters ``__next__`` (returns the time, for :meth:`consumed`)."""
        now = self._entered = self._clock()
        return now

    def left(self) -> None:
        """The consumer left ``__next__`` without a batch (end of pass, error, timeout): the time
        it waited is waited time, and the trainer's own time starts again now."""
        now = self._clock()
        with self._lock:
            entered, self._entered = self._entered, None
            if entered is None:
                return
            wait = max(now - entered, 0.0)
            busy = self._busy(entered)
            self._last_exit = now
            self._pass_wait += wait
            self._total_wait += wait
            self._window.add(self._sec(now), min(wait, WINDOW), busy, 0, 0)

    def consumed(self, entered: float, samples: int) -> None:
        """The consumer left ``__next__`` with a batch; it entered at ``entered``."""
        now = self._clock()
        wait = max(now - entered, 0.0)
        with self._lock:
            self._entered = None
            busy = self._busy(entered)
            self._last_exit = now
            self._pass_wait += wait
            self._total_wait += wait
            self._pass_batches += 1
            self._pass_samples += samples
            self._window.add(self._sec(now), min(wait, WINDOW), busy, samples, 1)
            due = now >= self._next_summary
        if due:
            self._summary(now)

    def _busy(self, entered: float) -> float:
        """The trainer's own time before it entered ``__next__`` at ``entered`` (lock held)."""
        last = self._last_exit
        return min(max(entered - last, 0.0), WINDOW) if last is not None else 0.0

    def _sec(self, now: float) -> int:
        """The window's second for ``now`` (a late writer lands in the newest second)."""
        return max(int(now), self._window.sec - _SLOTS + 1)

    def delivered(
        self,
        address: str,
        samples: int,
        nbytes: int | None,
        seconds_per_batch: float | None,
        wire: int | None = None,
        arriving: float = 0.0,
        whole: bool = True,
    ) -> None:
        """A worker's batch was accepted (reader thread); ``nbytes`` None: its size is unknown;
        ``wire``: its bytes on the wire (default ``nbytes``); ``arriving``: seconds from its
        header to its last byte; ``whole`` False: a later part of a split first batch (its
        samples and bytes count, the batch was counted with its first part)."""
        now = self._clock()
        with self._lock:
            w = self._workers.get(address)
            if w is None:
                w = self._workers[address] = _Worker()
            sec = max(int(now), w.sec - _SLOTS + 1)
            w.advance(sec)
            w.slots[sec % _SLOTS] += samples
            w.recent += samples
            w.batches += whole
            w.samples += samples
            if seconds_per_batch:
                w.spb = seconds_per_batch
            if nbytes is not None:
                self._bytes += nbytes
                self._wire += nbytes if wire is None else wire
                self._sized += whole
            if arriving:
                w.arriving[sec % _SLOTS] += arriving
                w.arriving_recent += arriving

    def mean_batch_bytes(self) -> float | None:
        """Mean reply bytes per batch of known size delivered so far (None before the first)."""
        with self._lock:
            return self._bytes / self._sized if self._sized else None

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
            w = self._workers.get(address)
            if w is None:
                w = self._workers[address] = _Worker()
            w.draining = False

    # -- reading ---------------------------------------------------------------------------
    def snapshot(self, workers=None, cache=None) -> LoaderStats:
        """The statistics now; ``workers``: the loader's current workers (a removed worker
        still shows, as draining, until nothing of it is in flight); ``cache``: (hit rate of
        the pass, per-worker figures) of a cached dataset."""
        now = self._clock()
        inflight: dict = {}
        known = True  # whether inflight is complete
        method = self._inflight() if self._inflight is not None else None
        if method is not None:
            try:
                inflight = method()
            except RuntimeError:  # a worker was added meanwhile: counts are shown as 0 once
                known = False
        with self._lock:
            sec = self._sec(now)
            window = self._window
            window.advance(sec)
            wait_30, busy_30 = max(window.totals[0], 0.0), max(window.totals[1], 0.0)  # float sums drift
            samples_30, batches_30 = int(window.totals[2]), int(window.totals[3])
            end = self._pass_end if self._pass_end is not None else now
            pass_seconds = max(end - self._pass_start, 0.0)
            # a wait in progress counts too: a trainer stuck in __next__ is input-bound
            entered = self._entered
            pending = min(max(now - entered, 0.0), WINDOW) if entered is not None else 0.0
            own = 0.0  # the trainer's time since it last left __next__, in a running pass
            if entered is None and self._running and self._last_exit is not None:
                own = min(max(now - self._last_exit, 0.0), WINDOW)
            # the rates are over the time the trainer was in a pass: not idle time before the
            # first pass or between passes (validation), which would dilute them
            span = max(wait_30 + busy_30 + pending + own, 1e-9)
            ws: dict[str, WorkerStats] = {}
            table = self._workers
            state_of = events.states().get
            held = inflight.get
            for address in table if workers is None else workers:  # the hot loop: one row each
                w = table.get(address, _EMPTY)
                if w.sec < sec:
                    w.advance(sec)
                ws[address] = _row(address, w, state_of(address, "serving"), span, held(address, 0))
            if len(ws) < len(table):  # workers removed from the loader: shown until drained
                for address in [a for a in table if a not in ws]:
                    w = table[address]
                    if w.draining and known and not held(address):
                        del table[address]  # removed and drained: forgotten
                        continue
                    w.advance(sec)
                    ws[address] = _row(address, w, state_of(address, "serving"), span, held(address, 0))
            out = LoaderStats(
                wait_fraction=min((self._pass_wait + pending) / max(pass_seconds, 1e-9), 1.0),
                wait_fraction_30s=min((wait_30 + pending) / span, 1.0),
                samples_per_s=samples_30 / span,
                batches=self._pass_batches,
                samples=self._pass_samples,
                bytes_received=self._bytes,
                wire_bytes_received=self._wire,
                float_images=self._float_images,
                pass_seconds=pass_seconds,
                wait_seconds=self._total_wait + pending,
                workers=ws,
            )
            arriving = [table[a].arriving_recent for a in ws if a in table]
            if arriving:
                out.link_busy = min(sum(arriving) / len(arriving) / span, 1.0)
        if cache is not None:
            _with_cache(out, *cache)
        out.advice = advise(out, batches_30, busy_30)
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


_EMPTY = _Worker()  # what a worker that delivered nothing shows (its counts stay 0)


def _row(address: str, w, state: str, span: float, inflight: int) -> WorkerStats:
    """One worker's row of a snapshot (``state`` is its membership state)."""
    if w.draining and state == "serving":
        state = "draining"
    return WorkerStats(
        address, state, w.recent / span, w.batches, w.samples, inflight, w.spb, w.requeued, w.hedged
    )


def _with_cache(out: LoaderStats, rate: float | None, per_worker: dict) -> None:
    out.cache_hit_rate = rate
    for address, f in per_worker.items():
        w = out.workers.get(address)
        if w is not None:
            w.cache_bytes, w.cache_hits = f.get("bytes"), f.get("hits")
        if f.get("bytes", 0) >= 0.95 * f.get("budget", 1 << 62):
            out.cache_full = True
