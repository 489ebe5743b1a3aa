"""The sums and heaps a :class:`~torchfeed.loader.scheduler.Scheduler` keeps over its workers.

Every scheduling decision is O(log workers) because of them: heaps keyed by drain time
(stale entries are skipped by version), a sorted list of the measured times and running
sums of rates, updated by :meth:`WorkerIndex.refresh` whenever one worker changes.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

__all__ = ["LATE_RATIO", "WorkerIndex", "WorkerState"]

LATE_RATIO = 2.0  # a request running this much longer than its worker's estimate raises it
_RESUM_EVERY = 1024  # re-add the rate sum from scratch after this many updates (float drift)


# Heap entry: (key, tie, order, version, worker); current while the worker's version is.
Entry = tuple[float, float, int, int, "WorkerState"]


@dataclass(eq=False)
class WorkerState:
    address: str
    in_flight: dict[int, float] = field(default_factory=dict)  # seq -> dispatch time
    seconds_per_batch: float | None = None
    last_done: float = 0.0
    completed: int = 0
    status: str = "alive"  # alive | draining | lost
    tie: float = field(default=0.0, repr=False)  # breaks ties between equal drain times
    order: int = field(default=0, repr=False)  # unique per scheduler: entries never compare workers
    late: float = 0.0  # how long its oldest request had run when that was found far too long
    version: int = field(default=0, repr=False)
    counted: tuple | None = field(default=None, repr=False)  # (spb, effective, in flight) in the sums

    @property
    def effective_seconds(self) -> float | None:
        """The estimate decisions use: the measured time, or more while a request is late."""
        spb = self.seconds_per_batch or 0.0
        return max(spb, self.late) or None

    @property
    def alive(self) -> bool:
        return self.status == "alive"


class WorkerIndex:
    """Sums over the alive workers and heaps of them, kept up to date as workers change.

    ``workers`` is the scheduler's own dict (shared, not copied); ``credits`` the requests a
    worker may hold. Heaps: alive workers with a free credit / all of them, with an estimate
    (key: drain time) / without (key: requests in flight); of non-lost workers holding
    requests, keyed by when the oldest began (hedging) / will be late.
    """

    def __init__(self, workers: dict[str, WorkerState], credits: int):
        self.workers = workers
        self.credits = credits
        self.times: list[float] = []  # sorted seconds_per_batch of the measured ones
        self.rate_sum = 0.0  # sum of 1 / effective_seconds of those that have one
        self.rate_updates = 0
        self.alive = 0
        self.unmeasured = 0
        self.in_flight = 0
        self.free_measured: list[Entry] = []
        self.all_measured: list[Entry] = []
        self.free_unmeasured: list[Entry] = []
        self.all_unmeasured: list[Entry] = []
        self.running: list[Entry] = []
        self.late: list[Entry] = []
        self.rebuild()

    def typical(self) -> float | None:
        """Median measured seconds per batch of the alive workers."""
        times = self.times
        return times[len(times) // 2] if times else None

    def refresh(self, w: WorkerState, bulk: bool = False) -> None:
        """Bring the sums and heaps up to date after any change to ``w``."""
        old = w.counted
        new = (w.seconds_per_batch, w.effective_seconds, len(w.in_flight)) if w.alive else None
        if old != new:
            if old is not None:
                self.alive -= 1
                self.in_flight -= old[2]
                if old[0] and (new is None or new[0] != old[0]):
                    del self.times[bisect.bisect_left(self.times, old[0])]
                if old[1] is None:
                    self.unmeasured -= 1
                elif new is None or new[1] != old[1]:
                    self.add_rate(-1.0 / old[1])
            if new is not None:
                self.alive += 1
                self.in_flight += new[2]
                if new[0] and (old is None or new[0] != old[0]):
                    if bulk:
                        self.times.append(new[0])  # sorted once at the end
                    else:
                        bisect.insort(self.times, new[0])
                if new[1] is None:
                    self.unmeasured += 1
                elif old is None or new[1] != old[1]:
                    self.add_rate(1.0 / new[1])
            w.counted = new
        w.version += 1
        push = self.append if bulk else self.push
        if new is not None:
            _, effective, n = new
            free = n < self.credits
            if effective:
                push(self.all_measured, (n + 1) * effective, w)
                if free:
                    push(self.free_measured, (n + 1) * effective, w)
            else:
                push(self.all_unmeasured, n, w)
                if free:
                    push(self.free_unmeasured, n, w)
        if w.status != "lost" and w.in_flight:
            began = self.began(w)
            push(self.running, began, w)
            estimate = w.effective_seconds or self.typical()
            if estimate:
                push(self.late, began + LATE_RATIO * estimate, w)

    @staticmethod
    def began(w: WorkerState) -> float:
        """When the oldest request of ``w`` began running (requests run one after another)."""
        return max(min(w.in_flight.values()), w.last_done)

    def raise_late(self, now: float) -> None:
        """A request that has run much longer than its worker's estimate says the worker is
        at least that slow: raise the estimate now rather than when (if) it finishes."""
        late = self.late
        while late and late[0][0] < now:
            entry = heapq.heappop(late)
            w = entry[4]
            if entry[3] != w.version:
                continue
            age = now - self.began(w)
            estimate = w.effective_seconds or self.typical()
            if estimate and age > LATE_RATIO * estimate:
                w.late = age
            self.refresh(w)  # a new entry: later, or keyed by a changed typical time

    def rebuild(self) -> None:
        """Sums and heaps from scratch: appends, one sort and one heapify per structure."""
        self.times, self.alive, self.unmeasured, self.in_flight = [], 0, 0, 0
        heaps = (
            self.free_measured,
            self.all_measured,
            self.free_unmeasured,
            self.all_unmeasured,
            self.running,
            self.late,
        )
        for heap in heaps:
            heap.clear()
        for w in self.workers.values():
            w.counted = None
        for w in self.workers.values():
            self.refresh(w, bulk=True)
        self.times.sort()
        self.rate_sum = self.exact_rate_sum()
        for heap in heaps:
            heapq.heapify(heap)

    def exact_rate_sum(self) -> float:
        return math.fsum(1.0 / w.counted[1] for w in self.workers.values() if w.counted and w.counted[1])

    def add_rate(self, delta: float) -> None:
        self.rate_updates += 1
        if self.rate_updates % _RESUM_EVERY == 0:
            self.rate_sum = self.exact_rate_sum()
        else:
            self.rate_sum += delta

    @staticmethod
    def append(heap: list[Entry], key: float, w: WorkerState) -> None:
        heap.append((key, w.tie, w.order, w.version, w))

    def push(self, heap: list[Entry], key: float, w: WorkerState) -> None:
        heapq.heappush(heap, (key, w.tie, w.order, w.version, w))
        if len(heap) > 4 * len(self.workers) + 64:  # mostly stale entries: drop them
            heap[:] = [e for e in heap if e[3] == e[4].version]
            heapq.heapify(heap)

    @staticmethod
    def top(heap: list[Entry], exclude: WorkerState | None = None) -> Entry | None:
        while heap and heap[0][3] != heap[0][4].version:
            heapq.heappop(heap)
        if not heap or heap[0][4] is not exclude:
            return heap[0] if heap else None
        held = heapq.heappop(heap)
        second = WorkerIndex.top(heap)
        heapq.heappush(heap, held)
        return second

    def best(
        self, measured: list[Entry], unmeasured: list[Entry], exclude: WorkerState | None = None
    ) -> tuple[float, WorkerState] | None:
        """(drain time, worker) of the soonest-draining worker of the two heaps."""
        m = self.top(measured, exclude)
        u = self.top(unmeasured, exclude)
        if u is not None:
            u = ((u[0] + 1) * (self.typical() or 1.0),) + u[1:]
        best = min((e for e in (m, u) if e is not None), default=None)
        return None if best is None else (best[0], best[4])

    def total_rate(self, typical: float) -> float:
        return self.rate_sum + self.unmeasured / typical
