"""What a pass reports about itself: the loader's statistics and a cached dataset's hit rate.

A pass calls its :class:`PassObserver` (``PassPlan.stats``) unconditionally wherever
something is counted: the consumer entering and leaving ``__next__``, a reply accepted,
a worker lost, drained or joined, a batch hedged, the pass's start and end. The base
class records nothing; :class:`PassStats` records into the loader's
:class:`~torchfeed.stats.Accounting` (O(1) per call, see :mod:`torchfeed.stats`) and, over a
:func:`~torchfeed.cached` dataset, reads the workers' cache figures through the loader's
:class:`Probe`.

Threads: every method but :meth:`PassObserver.finished` may be called with the pass's lock
held (from the consumer, the dispatch thread or a reader thread), so none of them waits for
anything. ``finished`` runs on the consumer's thread with no lock held, once the pass has
delivered its last batch: it may wait (at most :data:`FINAL_SECONDS`) for the workers' cache
figures, so that the figures of a finished pass are final when the pass ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import client
from ..stats import Accounting
from .cache import counts

log = logging.getLogger("torchfeed.loader")

FINAL_SECONDS = 5.0
"""How long the end of a pass waits for the workers' cache figures (a worker that has not
answered by then keeps the figures it gave before)."""

_EVERY = 0.5  # seconds between two readings of the cache figures while a pass runs


class PassObserver:
    """What a pass reports while it runs; this base records nothing (see the module doc)."""

    def started(self, workers: list[str], inflight: Callable[[], dict[str, int]]) -> None:
        """The pass starts on ``workers``; ``inflight()`` gives the requests each holds now."""

    def ended(self) -> None:
        """The pass closed (it finished, failed or was left): its time stops here."""

    def finished(self) -> None:
        """The pass delivered its last batch (the consumer's thread, no lock held)."""

    def enter(self) -> float:
        """The consumer enters ``__next__``; returns what :meth:`consumed` takes."""
        return 0.0

    def left(self) -> None:
        """The consumer left ``__next__`` without a batch (the end, an error, a caught Timeout)."""

    def consumed(self, entered: float, samples: int) -> None:
        """The consumer left ``__next__`` with a batch of ``samples`` samples."""

    def inspect(self, batch: Any) -> None:
        """A batch handed to the user (the first of each pass is looked at for the advice)."""

    def reply(
        self, address: str, samples: int, seconds_per_batch: float | None = None, whole: bool = True
    ) -> None:
        """A worker's reply was accepted (its reader thread, inside the result callback);
        ``whole`` False: a later part of a split first batch."""

    def preloaded(self, address: str, samples: int, nbytes: int) -> None:
        """A batch the previous pass loaded ahead for this one was taken (size ``nbytes``)."""

    def requeued(self, address: str, count: int) -> None:
        """A lost worker held ``count`` batches: they go elsewhere."""

    def hedged(self, address: str) -> None:
        """A batch held by ``address`` was duplicated elsewhere (it is overdue)."""

    def joined(self, address: str) -> None:
        """A worker joined the pass (or came back)."""

    def draining(self, address: str) -> None:
        """A worker was removed: it finishes what it holds."""

    def mean_batch_bytes(self) -> float | None:
        """Reply bytes per batch so far (None when unknown): how deep the pipeline may go."""
        return None


class PassStats(PassObserver):
    """One pass's reports into its loader's ``accounting`` and, for a cached dataset, ``probe``."""

    def __init__(self, accounting: Accounting, probe: Probe | None = None):
        self._acc = accounting
        self._probe = probe
        self._number: int | None = None  # the pass's number in the accounting, once started
        self._final = False

    def started(self, workers: list[str], inflight: Callable[[], dict[str, int]]) -> None:
        self._number = self._acc.pass_started(workers, inflight)
        if self._probe is not None:
            self._probe.pass_started()

    def ended(self) -> None:
        if self._number is not None:  # numbered: a pass closed late does not end a newer one
            self._acc.pass_ended(self._number)

    def finished(self) -> None:
        if self._probe is None or self._final:
            return
        self._final = True
        self._probe.pass_ended()

    def enter(self) -> float:
        return self._acc.enter()

    def left(self) -> None:
        self._acc.left()

    def consumed(self, entered: float, samples: int) -> None:
        self._acc.consumed(entered, samples)

    def inspect(self, batch: Any) -> None:
        self._acc.inspect(batch)

    def reply(
        self, address: str, samples: int, seconds_per_batch: float | None = None, whole: bool = True
    ) -> None:
        wire, arriving = client.reply_wire()
        self._acc.delivered(address, samples, client.reply_bytes(), seconds_per_batch, wire, arriving, whole)

    def preloaded(self, address: str, samples: int, nbytes: int) -> None:
        self._acc.delivered(address, samples, nbytes, None)

    def requeued(self, address: str, count: int) -> None:
        self._acc.requeued(address, count)

    def hedged(self, address: str) -> None:
        self._acc.hedged(address)

    def joined(self, address: str) -> None:
        self._acc.joined(address)

    def draining(self, address: str) -> None:
        self._acc.draining(address)

    def mean_batch_bytes(self) -> float | None:
        return self._acc.mean_batch_bytes()


def _figures(value: Any) -> dict | None:
    """A worker's answer to ``cache.counts``, if it is one (hits, misses, bytes, budget)."""
    if isinstance(value, dict) and all(isinstance(v, int) for v in value.values()):
        return value
    return None


class Probe:
    """The trainer's view of a cached dataset's hits, read from its workers: when a pass starts
    (the base its figures count from), at the first ``stats()`` of the pass and then at most
    every :data:`_EVERY` seconds while it is called (without blocking: an answer shows at a
    later call), and once more when the pass finishes (waited for: the figures of a finished
    pass are final)."""

    def __init__(self, dataset):
        self.dataset = dataset  # a RemoteDataset over a cached() factory
        self._lock = threading.Lock()
        self.latest: dict[str, dict] = {}
        self.base: dict[str, dict] | None = None
        self._base_asked: dict[str, Any] = {}  # the futures of the pass's base reading
        self._asked = 0.0  # when the latest reading was asked for
        self._readings = 0  # numbers the readings: an older answer never replaces a newer one
        self._shown = 0  # the number of the reading in ``latest``
        self._started = 0  # the number of the pass's base reading (older ones are of an older pass)
        self._final = False  # the pass finished: its figures no longer change

    def _ask(self) -> dict[str, Any]:
        """Ask every live worker of the dataset for its figures (futures, not waited for)."""
        ds = self.dataset
        futs = {}
        for w in ds.alive_workers():
            try:
                futs[w] = ds.session.rpc_async(
                    w, counts, args=(ds.ref(w),), timeout=ds.timeout, secret=ds.secret
                )
            except Exception:  # noqa: BLE001 - a worker gone meanwhile: no figures from it
                continue
        return futs

    def _show(self, number: int, got: dict[str, dict]) -> None:
        """Reading ``number`` answered ``got`` (lock held)."""
        if not self._final and number >= self._started and number > self._shown:
            self._shown = number
            self.latest = got
            if self.base is None:
                self.base = dict(got)

    def pass_started(self) -> None:
        futs = self._ask()
        with self._lock:
            self._readings += 1
            number = self._started = self._readings
            self._final = False
            self._asked = 0.0  # the first stats() of the pass asks again: a short pass shows a rate too
            self.base = None
            self._base_asked = futs
        self._collect(number, futs)

    def refresh(self, every: float = _EVERY) -> None:
        """A new reading, unless one was asked for less than ``every`` seconds ago."""
        now = time.monotonic()
        with self._lock:
            if self._final or now - self._asked < every:
                return
            self._asked = now
            self._readings += 1
            number = self._readings
        self._collect(number, self._ask())

    def _collect(self, number: int, futs: dict[str, Any]) -> None:
        """Show reading ``number`` once every worker answered (on the last answer's reader thread)."""
        if not futs:
            return
        left = [len(futs)]
        got: dict[str, dict] = {}

        def one(w: str, f) -> None:
            try:
                figures = _figures(f.value())
                if figures is not None:
                    got[w] = figures
            except Exception:  # noqa: BLE001 - no figures from a failed worker
                pass
            with self._lock:
                left[0] -= 1
                if left[0] == 0:
                    self._show(number, got)

        for w, f in futs.items():
            f.add_done_callback(lambda f, w=w: one(w, f))

    def pass_ended(self, timeout: float = FINAL_SECONDS) -> None:
        """The pass finished: read the figures now and wait for them (the consumer's thread)."""
        futs = self._ask()
        with self._lock:
            self._readings += 1
            number = self._readings
            base_asked = self._base_asked
        deadline = time.monotonic() + timeout
        answers = client.wait_all(base_asked, timeout)
        base = {w: f for w in base_asked if (f := _figures(answers[w])) is not None}
        answers = client.wait_all(futs, max(deadline - time.monotonic(), 0.0))
        got = {w: f for w in futs if (f := _figures(answers[w])) is not None}
        with self._lock:
            if self.base is None:
                self.base = base
            self._show(number, got)
            self._final = True

    def figures(self) -> tuple[float | None, dict[str, dict]]:
        """The hit rate since the pass started (None before it is known) and per-worker figures."""
        self.refresh()
        with self._lock:
            latest, base = self.latest, self.base or {}
        hits = misses = 0
        for w, f in latest.items():
            b = base.get(w, {})
            # (a reading can run a moment before the base on a worker's other executor)
            hits += max(f["hits"] - b.get("hits", 0), 0)
            misses += max(f["misses"] - b.get("misses", 0), 0)
        rate = hits / (hits + misses) if hits + misses > 0 else None
        return rate, latest
