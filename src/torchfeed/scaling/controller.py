"""Right-sized worker pools: :func:`autoscale` grows and shrinks a pool from a loader's stats.

A background thread (:class:`Autoscaler`) reads :meth:`RemoteDataLoader.stats` every
``interval`` seconds, measures over its last ``window`` seconds how long the trainer
waited, how fast it would take samples and how fast one worker delivers them, and asks
:class:`torchfeed.scaling.Policy` what to do (up quickly, down slowly, hysteresis,
cool-downs, bounds). It owns every change of membership:

* workers the pool reports ready (:meth:`WorkerPool.addresses`) join the loader's dataset
  (:meth:`RemoteDataset.add_workers`);
* to shrink, it removes workers from the dataset (:meth:`RemoteDataset.remove_workers`):
  running passes give them no new batch and their batches in flight finish (shown as
  ``draining`` in the stats); once nothing of theirs is in flight (or ``drain_timeout``
  passed: a batch still held is then requeued when the worker stops, as for a lost
  worker) it asks the pool to retire them. No batch is lost or delivered twice.
* a pool that does not grow (the engine refuses, jobs queue) is logged, once, and
  training goes on with the workers there are.

Each decision is one INFO line on the ``torchfeed.autoscale`` logger and an entry of
:attr:`Autoscaler.history`; :meth:`Autoscaler.stats` gives the current state.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..loader.dataset import RemoteDataset
from ..loader.views import Source
from .policy import Decision, Policy, Reading
from .pool import WorkerPool
from .tiers import Tiers

log = logging.getLogger("torchfeed.autoscale")


@dataclass
class AutoscaleStats:
    """The controller's state: see :meth:`Autoscaler.stats`."""

    workers: list[str]  # serving: in the dataset
    requested: int  # asked of the pool, not counting the draining ones
    draining: list[str]  # removed from the dataset, not retired yet
    wait: float | None  # the trainer's wait over the last window
    need: int | None  # workers that would keep up, as last estimated
    decisions: list[Decision] = field(default_factory=list)  # the latest, oldest first

    @property
    def last(self) -> str:
        """The last decision as its log line ("" before the first)."""
        return self.decisions[-1].line() if self.decisions else ""


class Autoscaler:
    """The controller thread of :func:`autoscale` (a context manager; :meth:`close` stops it)."""

    def __init__(
        self,
        loader: Any,
        pool: WorkerPool,
        policy: Policy,
        *,
        interval: float = 2.0,
        window: float = 10.0,
        drain_timeout: float = 60.0,
        start_timeout: float = 120.0,
    ):
        if not isinstance(pool, WorkerPool):
            raise TypeError(
                f"autoscale needs a pool with addresses(), requested(), scale(n), retire(addresses) and "
                f"close() (torchfeed.scaling.pool.WorkerPool), got {type(pool).__name__}"
            )
        if interval <= 0 or window < interval:
            raise ValueError(f"need 0 < interval <= window, got interval={interval}, window={window}")
        self.loader = loader
        self.pool = pool
        self.policy = policy
        self.parts: list[RemoteDataset] = Source(loader.dataset).parts
        self.interval = interval
        self.window = window
        self.drain_timeout = drain_timeout
        self.start_timeout = start_timeout
        self.history: deque[Decision] = deque(maxlen=1000)
        self._samples: deque[tuple[float, float, dict[str, int]]] = deque()  # time, wait_seconds, samples
        self._draining: dict[str, tuple[float, int]] = {}  # address -> (since, readings with none in flight)
        self._seen: set[str] = set()  # addresses the pool listed
        self._retired: set[str] = set()
        self._asked_at: float | None = None  # when the pool was last asked to grow
        self._stuck_warned = False
        self._max_noted = False
        self._last: Reading | None = None
        self._need: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchfeed-autoscale", daemon=True)
        self._thread.start()

    # -- public --------------------------------------------------------------------------
    def stats(self) -> AutoscaleStats:
        """Serving and draining workers, the request, the last reading and the decisions."""
        try:
            asked = self.pool.requested()
        except Exception:  # noqa: BLE001 - a pool's engine having a bad moment
            asked = None
        with self._lock:
            last, members, draining = self._last, self._members(), list(self._draining)
            return AutoscaleStats(
                workers=members,
                requested=len(members) if asked is None else max(asked - len(draining), len(members)),
                draining=draining,
                wait=last.wait if last else None,
                need=self._need,
                decisions=list(self.history),
            )

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread; workers still draining are retired now (a batch one still holds is
        requeued by the loader when it stops). The pool itself stays open."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._lock:
            left = list(self._draining)
            self._draining.clear()
        if left:
            self._retire(left)

    def __enter__(self) -> Autoscaler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - the controller must outlive a bad reading
                log.exception("autoscale: this round failed; trying again in %g s", self.interval)

    def tick(self, now: float) -> Decision | None:
        """One round: read the stats, sync membership, retire drained workers, decide, act."""
        s = self.loader.stats()
        delivered = {a: w.samples for a, w in s.workers.items()}
        self._samples.append((now, s.wait_seconds, delivered))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        self._sync(now)
        self._retire_drained(s, now)
        reading = self._reading(s, now)
        with self._lock:
            self._last = reading
            self._need = self.policy.need(reading)
        log.debug("autoscale: %s; need %s", reading, self._need)
        decision = self.policy.decide(reading)
        if decision is not None:
            self._apply(decision, s, now)
        self._watch_growth(reading, now)
        return decision

    # -- membership ------------------------------------------------------------------------
    def _members(self) -> list[str]:
        first, rest = self.parts[0], self.parts[1:]
        return [w for w in first.workers if all(w in p.workers for p in rest)]

    def _sync(self, now: float) -> None:
        """Add the workers the pool made ready; drop the ones it no longer has (their engine
        lost them: the loader already treats them as lost)."""
        try:
            ready = list(self.pool.addresses())
        except Exception as exc:  # noqa: BLE001 - a pool's engine having a bad moment
            log.warning("autoscale: could not list the pool's workers (%s: %s)", type(exc).__name__, exc)
            return
        members = set(self._members())
        new = [a for a in ready if a not in members and a not in self._draining and a not in self._retired]
        gone = [a for a in self._seen if a in members and a not in ready]
        self._seen.update(ready)
        if gone:
            log.warning("autoscale: the pool no longer has %s; removed from the dataset", ", ".join(gone))
            for part in self.parts:
                part.remove_workers(gone)
            self._seen.difference_update(gone)
        if new:
            for part in self.parts:
                part.add_workers(new)
            log.debug("autoscale: %d worker(s) joined: %s", len(new), ", ".join(new))

    def _retire_drained(self, s: Any, now: float) -> None:
        done = []
        for address, (since, idle) in list(self._draining.items()):
            row = s.workers.get(address)
            held = row.inflight if row is not None else 0
            idle = idle + 1 if held == 0 else 0
            self._draining[address] = (since, idle)
            if idle >= 2:  # two readings in a row: an in-flight count read mid-change shows 0 once
                done.append(address)
            elif now - since > self.drain_timeout:
                log.warning(
                    "autoscale: worker %s still holds %d batch(es) %g s after it was removed; retiring it "
                    "anyway (the loader requeues them on the other workers)",
                    address,
                    held,
                    self.drain_timeout,
                )
                done.append(address)
        if done:
            with self._lock:
                for address in done:
                    self._draining.pop(address, None)
            self._retire(done)

    def _retire(self, addresses: Sequence[str]) -> None:
        self._retired.update(addresses)
        self._seen.difference_update(addresses)
        try:
            self.pool.retire(list(addresses))
        except Exception as exc:  # noqa: BLE001 - the workers are out of the dataset already
            log.warning(
                "autoscale: the pool could not retire %s (%s: %s); they no longer get batches",
                ", ".join(addresses),
                type(exc).__name__,
                exc,
            )
        else:
            log.debug("autoscale: retired %s", ", ".join(addresses))

    # -- measuring ---------------------------------------------------------------------------
    def _reading(self, s: Any, now: float) -> Reading:
        t0, wait0, then = self._samples[0]
        _, wait1, current = self._samples[-1]
        span = now - t0
        members = self._members()
        try:
            requested = self.pool.requested() - len(self._draining)
        except Exception:  # noqa: BLE001
            requested = len(members)
        requested = max(requested, len(members))
        if span <= 0:  # the first reading: nothing measured yet
            return Reading(now, len(members), requested, 0.0, active=False)
        waited = min(max(wait1 - wait0, 0.0), span)
        delivered = sum(max(n - then.get(a, 0), 0) for a, n in current.items())
        capacity, measured = [], []
        for a in members:
            w = s.workers.get(a)
            if w is None:
                continue
            if w.mean_batch_seconds and w.batches:
                capacity.append(w.samples / w.batches / w.mean_batch_seconds)
            if a in then:
                measured.append((current.get(a, 0) - then[a]) / span)
        per_worker = max(
            statistics.median(capacity) if capacity else 0.0, statistics.median(measured) if measured else 0.0
        )
        busy = max(span - waited, 1e-3)
        return Reading(
            time=now,
            workers=len(members),
            requested=requested,
            wait=waited / span,
            demand=delivered / busy if delivered else None,
            per_worker=per_worker or None,
            active=delivered > 0 or waited > 0.05 * span,
        )

    # -- acting -----------------------------------------------------------------------------
    def _apply(self, d: Decision, s: Any, now: float) -> None:
        with self._lock:
            self.history.append(d)
        log.info(d.line())
        if d.action == "up":
            self._asked_at = now
            self._stuck_warned = False
            try:
                self.pool.scale(d.target + len(self._draining))
            except Exception as exc:  # noqa: BLE001 - the engine refused: keep what there is
                log.warning(
                    "autoscale: the pool refused to grow to %d workers (%s: %s); training goes on with %d",
                    d.target,
                    type(exc).__name__,
                    exc,
                    d.before,
                )
            return
        members = self._members()
        rows = s.workers

        expense = getattr(self.pool, "expense", None)  # Tiers: the dearest pool's workers go first

        def cost(a: str) -> tuple:  # then the fewest in flight, then the slowest
            w = rows.get(a)
            dear = -expense(a) if expense is not None else 0
            return (dear, w.inflight, -(w.mean_batch_seconds or 0.0)) if w is not None else (dear, 0, 0.0)

        going = sorted(members, key=cost)[: max(len(members) - d.target, 0)]
        if not going:
            return
        with self._lock:
            for a in going:
                self._draining[a] = (now, 0)
        for part in self.parts:
            part.remove_workers(going)

    def _watch_growth(self, r: Reading, now: float) -> None:
        """Say once when the pool does not deliver the workers asked for, or stays at its maximum."""
        starting = r.requested - r.workers
        if starting <= 0:
            self._stuck_warned = False
        elif (
            not self._stuck_warned
            and self._asked_at is not None
            and now - self._asked_at > self.start_timeout
        ):
            self._stuck_warned = True
            log.warning(
                "autoscale: the pool did not grow: %d worker(s) asked for %.0f s ago are not ready "
                "(the cluster may be at its maximum, its jobs queued, or the engine refused); training "
                "goes on with %d",
                starting,
                now - self._asked_at,
                r.workers,
            )
        limit = self.policy.max_workers
        at_max = limit is not None and r.requested >= limit and r.wait > self.policy.target_wait
        if at_max and not self._max_noted:
            log.info(
                "autoscale: the trainer waits %.0f%% of the time but the pool is at max_workers=%d",
                100 * r.wait,
                limit,
            )
        self._max_noted = at_max


def autoscale(
    loader: Any,
    pool: WorkerPool | Sequence[WorkerPool],
    *,
    min_workers: int = 1,
    max_workers: int | None = None,
    target_wait: float = 0.1,
    low_wait: float | None = None,
    headroom: float = 1.1,
    interval: float = 2.0,
    window: float = 10.0,
    up_cooldown: float = 10.0,
    down_after: float = 30.0,
    down_cooldown: float = 20.0,
    drain_timeout: float = 60.0,
    start_timeout: float = 120.0,
) -> Autoscaler:
    """Grow and shrink ``pool`` so that ``loader``'s trainer waits about ``target_wait`` of its time.

    Starts a background thread and returns its :class:`Autoscaler` (``close()`` or use it
    as a context manager). Workers the pool makes ready join ``loader.dataset``; workers to
    go are drained first (their batches in flight are delivered) and then retired by the pool.

    Parameters
    ----------
    loader : RemoteDataLoader
        The loader whose wait drives the decisions; its dataset (a RemoteDataset, or a view of
        RemoteDatasets) gains and loses the workers.
    pool : torchfeed.scaling.pool.WorkerPool, or a list of them
        E.g. ``torchfeed.dask.Pool(cluster)`` or ``torchfeed.cluster.SlurmPool(...)``. A list is
        used cheapest first (:class:`torchfeed.scaling.tiers.Tiers`): e.g. ``[LocalPool(), remote]``
        grows the trainer machine's own workers up to its CPU budget before asking for remote
        ones, and drains the remote ones first.
    min_workers, max_workers : int
        Bounds (``max_workers`` None: no upper bound but the pool's).
    target_wait : float
        Grow while the trainer waits more than this share of its time for data.
    low_wait : float, optional
        Shrink only while it waits less than this (default ``target_wait / 2``).
    headroom : float
        Spare capacity kept: workers are sized for ``headroom`` times the trainer's demand.
    interval, window : float
        Seconds between two rounds, and over which waits and rates are measured.
    up_cooldown : float
        Seconds between two steps up once the workers asked for are ready.
    down_after : float
        Seconds the trainer must wait less than ``low_wait`` before a step down.
    down_cooldown : float
        Seconds after any change before a step down (a step removes at most half the workers).
    drain_timeout : float
        Seconds a removed worker may take to finish its batches before it is retired anyway.
    start_timeout : float
        Seconds after which workers asked for and not ready are reported (once) as not coming.
    """
    if min_workers < 1:
        raise ValueError(f"min_workers must be >= 1 (a loader needs a worker), got {min_workers}")
    one: WorkerPool = Tiers(pool) if isinstance(pool, (list, tuple)) else pool  # type: ignore[assignment]
    policy = Policy(
        min_workers=min_workers,
        max_workers=max_workers,
        target_wait=target_wait,
        low_wait=low_wait,
        headroom=headroom,
        up_cooldown=up_cooldown,
        down_after=down_after,
        down_cooldown=down_cooldown,
    )
    return Autoscaler(
        loader,
        one,
        policy,
        interval=interval,
        window=window,
        drain_timeout=drain_timeout,
        start_timeout=start_timeout,
    )


__all__ = ["AutoscaleStats", "Autoscaler", "autoscale"]
