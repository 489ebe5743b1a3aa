"""Is the trainer waiting for data? Live loader and per-worker statistics.

Every :class:`RemoteDataLoader` owns one :class:`Accounting`: the consumer's thread
records how long each ``__next__`` waited for its batch, reader threads record each
batch a worker delivered. Both are O(1) per batch (a few counters and one-second buckets
covering the last :data:`WINDOW` seconds: fixed memory at any batch rate) under a lock
held for microseconds. :meth:`RemoteDataLoader.stats` turns them into a :class:`LoaderStats`.

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
from dataclasses import asdict, dataclass, field
from typing import Any

from . import events

log = logging.getLogger("torchfeed.stats")

WINDOW = 30.0  # seconds of the sliding window
_SLOTS = int(WINDOW)  # one-second buckets: the window is the last 29 to 30 seconds
_STATES = ("serving", "draining", "lost", "reconnecting")


@dataclass(slots=True)  # made for every worker at every stats() call: slots make that cheaper
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
    cache_bytes: int | None = None  # decoded samples its cache holds (torchfeed.cached datasets)
    cache_hits: int | None = None  # this loader's dataset's samples found in the pool's cache


@dataclass
class LoaderStats:
    """A snapshot of a loader: see :meth:`torchfeed.RemoteDataLoader.stats`."""

    wait_fraction: float  # share of wall time inside __next__ waiting, since the pass started
    wait_fraction_30s: float  # the same over the last 30 s
    samples_per_s: float  # delivered to the trainer, over the last 30 s
    batches: int  # delivered in this pass
    samples: int  # delivered in this pass
    bytes_received: int  # reply bytes received for this loader since it was made
    pass_seconds: float  # the current pass's length so far (the last pass's, once it ended)
    wait_seconds: float  # waited in __next__ since the loader was made (all passes)
    workers: dict[str, WorkerStats] = field(default_factory=dict)
    advice: str = ""
    wire_bytes_received: int = 0  # the same as they crossed the network (compressed, sealed)
    link_busy: float = 0.0  # share of the last 30 s the workers' replies spent arriving (mean per worker)
    float_images: bool = False  # batches hold float32 images (N, C, H, W): uint8 would cross in a quarter
    cache_hit_rate: float | None = None  # torchfeed.cached datasets: share of samples found cached, this pass
    cache_full: bool = False  # some worker's cache is at its --cache-size

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
            f"{prefix}wire_bytes_received": float(self.wire_bytes_received),
        }
        for address, w in self.workers.items():
            out[f"{prefix}workers/{address}/samples_per_s"] = w.samples_per_s
        if self.cache_hit_rate is not None:
            out[f"{prefix}cache_hit_rate"] = self.cache_hit_rate
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
        if self.cache_hit_rate is not None:
            held = sum(w.cache_bytes or 0 for w in self.workers.values())
            lines.append(
                f"cache: {self.cache_hit_rate:.0%} of this pass's samples found, {held / 1e6:.1f} MB held"
            )
        lines.append(self.advice)
        return "\n".join(lines)


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
    ) -> None:
        """A worker's batch was accepted (reader thread); ``nbytes`` None: its size is unknown;
        ``wire``: its bytes on the wire (default ``nbytes``); ``arriving``: seconds from its
        header to its last byte."""
        now = self._clock()
        with self._lock:
            w = self._workers.get(address)
            if w is None:
                w = self._workers[address] = _Worker()
            sec = max(int(now), w.sec - _SLOTS + 1)
            w.advance(sec)
            w.slots[sec % _SLOTS] += samples
            w.recent += samples
            w.batches += 1
            w.samples += samples
            if seconds_per_batch:
                w.spb = seconds_per_batch
            if nbytes is not None:
                self._bytes += nbytes
                self._wire += nbytes if wire is None else wire
                self._sized += 1
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


INPUT_BOUND = 0.3  # wait fractions above this are called input-bound
LINK_BOUND = 0.6  # an input-bound loader whose replies spend this share of the time arriving is link-bound


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


def _cache_advice(s: LoaderStats) -> str:
    """What the cache adds to an input-bound verdict (empty when it is not the bottleneck)."""
    rate = s.cache_hit_rate
    if rate is None or rate >= 0.9:
        return ""
    if s.cache_full:
        return (
            f"; the sample cache finds only {rate:.0%} of samples and is full: raise the workers' "
            "--cache-size (or cache a smaller form of each sample)"
        )
    return f"; the sample cache finds {rate:.0%} of samples so far (it fills during the first epoch)"


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
    if s.link_busy >= LINK_BOUND:
        return _link_advice(s, wait)
    rates = [w.samples_per_s for w in serving if w.samples_per_s > 0]
    if not rates:
        return f"input-bound: the trainer waits {wait:.0%} of the time and no worker delivered lately"
    per_worker = sum(rates) / len(rates)
    need = max(math.ceil(demand / per_worker), now_count + 1)
    shown = f"about {need}" if need <= 1000 else "more than 1000"
    return (
        f"input-bound: the trainer waits {wait:.0%} of the time; {shown} workers (now {now_count}) "
        "would keep up" + _cache_advice(s)
    )


def _link_advice(s: LoaderStats, wait: float) -> str:
    shrink = s.wire_bytes_received / s.bytes_received if s.bytes_received else 1.0
    text = (
        f"link-bound: the trainer waits {wait:.0%} of the time while the workers' replies spend {s.link_busy:.0%} "
        f"of it arriving (on the wire: {shrink:.2f} of their bytes); more workers will not help: "
    )
    if s.float_images:
        return text + (
            "send images as uint8 (a quarter of float32's bytes) and normalise them on the trainer's device, "
            "e.g. batch.to(device).float().div_(255), or give the link more bandwidth"
        )
    if shrink > 0.95:
        return (
            text
            + "send smaller dtypes or crops, leave compression='auto' on, or give the link more bandwidth"
        )
    return text + "send smaller dtypes or crops, or give the link more bandwidth"


__all__ = ["Accounting", "LoaderStats", "WorkerStats", "advise", "WINDOW"]
