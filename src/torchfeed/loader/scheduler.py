"""Which batch goes to which worker, and when.

Pure bookkeeping, no I/O, so it can be tested alone. The loader feeds it batch
sequence numbers, asks it for dispatch decisions and reports completions and lost
workers. Time comes from ``clock`` (``time.monotonic`` by default) or from the ``now``
argument of the methods that need it, so a fake clock drives it in tests and
simulations (``benchmarks/simulate.py``).

* **Credits.** A worker holds at most ``credits`` requests (the loader's
  ``prefetch_factor``); a finished request returns its credit at once.
* **Least loaded first.** Among workers with a free credit, the one whose queue
  would drain soonest (in-flight count plus one, times its measured time per batch) is
  served. A worker not measured yet counts as a typical one (the median of the measured
  ones); with no measurement at all, the one with the fewest requests in flight is
  served. Ties are broken by a per-scheduler random order (``seed``), so that trainers
  sharing workers do not all start on the same ones.
* **Look-ahead for slow workers.** Batches are delivered in order, so a slow worker
  given the *next* batch would hold up every later one. A worker is instead given the
  batch that will be needed about when it can finish it, estimated from the measured
  rates; the batches it skips go to faster workers. With no measurements yet every
  worker takes the lowest pending batch.
* **End of the pass.** Once the number of batches of the pass is known
  (``pass_length``, or ``exhausted``), a worker gets no batch that it would finish later
  than the other workers would finish all the remaining ones (their combined rate, and
  never sooner than the soonest of them): a slow worker waits instead of holding up the
  tail. Should no batch go out for twice the time the others were expected to need
  (stalled workers), the slow worker is served again.
* **Late requests.** A request running more than twice its worker's estimate raises
  the worker's effective estimate to its age at once (not only when, or if, it ends).
* **Window.** No batch beyond ``delivered + window`` is dispatched, which bounds the
  memory held by results waiting for an earlier batch. Once rates are measured the
  window widens (up to ``max_window``) to cover what the other workers deliver while the
  slowest one works through its queue, so its look-ahead batches are not clamped.
* **Loss.** The batches of a lost worker return to the pending set, where they are the
  lowest and so are dispatched first. The oldest of them (the one the worker was most
  likely executing) is blamed: the pass counts the deaths against it (loader/faults.py).
* **Draining.** A worker being removed gets no new batches; its in-flight ones finish.
* **Hedging.** A batch needed soon that has been running much longer than the typical
  batch is duplicated on the worker with a free credit that would finish it soonest;
  the first result wins and the other request is cancelled.

Every decision is O(log workers): heaps keyed by drain time (stale entries are skipped
by version), a sorted list of the measured times and running sums, no scan of the
workers; a hedge check looks only at workers that have been busy past the limit.
"""

from __future__ import annotations

import bisect
import heapq
import random
import time
from collections.abc import Callable, Iterable, Mapping

from .workerindex import WorkerIndex, WorkerState

_ALPHA = 0.3  # weight of the newest sample in the per-worker time estimate
_SLOW_RATIO = 1.5  # a worker this much slower than the best one skips ahead
_HOLD_SLACK = 2.0  # end-of-pass withholding lasts at most this times the others' estimate


class Scheduler:
    """Dispatch decisions for one pass over the data.

    Parameters
    ----------
    workers : iterable of str
        Addresses of the workers available at the start.
    credits : int
        Requests a worker may hold at once.
    window : int
        Batches dispatched beyond the last delivered one, at least (it widens with
        measured rates up to ``max_window``, default four times ``window``).
    max_window : int, optional
    clock : callable, optional
        Returns the current time in seconds; used where a method is called without
        ``now``. ``time.monotonic`` by default.
    pass_length : int, optional
        Number of batches in this pass, when known in advance (``len(loader)``). Without
        it the end is known once ``exhausted`` is set.
    estimates : mapping of str to float, optional
        Seconds per batch of workers, as measured in an earlier pass
        (:meth:`estimates`): the look-ahead and the end-of-pass rule work from the
        first batch instead of after every worker has finished one.
    seed : int, optional
        Seeds the order that breaks ties between equally loaded workers (random by
        default).
    """

    def __init__(
        self,
        workers: Iterable[str],
        credits: int,
        window: int,
        max_window: int | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        pass_length: int | None = None,
        estimates: Mapping[str, float] | None = None,
        seed: int | None = None,
    ):
        if credits < 1:
            raise ValueError("credits must be >= 1")
        self.credits = credits
        self.base_window = self.window = max(window, 1)
        self.max_window = max(max_window or 4 * self.base_window, self.base_window)
        self.clock = clock
        self.pass_length = pass_length
        self._estimates = dict(estimates or {})
        self._random = random.Random(seed)
        self._next_order = 0
        self._holders: dict[int, list[WorkerState]] = {}  # seq -> workers that hold it
        self._hold_until: float | None = None  # end-of-pass withholding expires then
        self.workers: dict[str, WorkerState] = {}
        for address in workers:
            if address not in self.workers:
                self.workers[address] = self._new_state(address)
        self.index = WorkerIndex(self.workers, credits)  # sums and heaps over the workers
        self._pending: list[int] = []  # sorted sequence numbers not yet dispatched
        self.known = 0  # batches 0..known-1 have been added
        self.exhausted = False  # no more batches will be added
        self.delivered = 0  # batches below this were handed to the consumer
        self.done: set[int] = set()  # completed, not yet delivered
        self.hedged: set[int] = set()  # seqs that were duplicated once
        self._resize_window()  # from the carried estimates, if any: the first pull covers it

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    # -- membership ---------------------------------------------------------
    def add_worker(self, address: str) -> None:
        state = self.workers.get(address)
        if state is None or state.status == "lost":
            state = self.workers[address] = self._new_state(address)
        else:
            state.status = "alive"
        self.index.refresh(state)

    def _new_state(self, address: str) -> WorkerState:
        self._next_order += 1
        estimate = self._estimates.get(address)
        return WorkerState(
            address,
            seconds_per_batch=estimate if estimate and estimate > 0 else None,
            tie=self._random.random(),
            order=self._next_order,
        )

    def alive_workers(self) -> list[str]:
        return [w.address for w in self.workers.values() if w.alive]

    def serving_workers(self) -> list[str]:
        """Workers that are alive or still finishing their batches."""
        return [w.address for w in self.workers.values() if w.status != "lost"]

    def drain_worker(self, address: str) -> None:
        state = self.workers.get(address)
        if state is not None and state.status == "alive":
            state.status = "draining"
            self.index.refresh(state)

    def worker_lost(self, address: str, blame: bool = True) -> tuple[list[int], int | None]:
        """Mark a worker dead. Return its batches now pending again, and the blamed one.

        ``blame=False``: the connection was closed on purpose, which says nothing about the
        batch it was running (no death is counted against it)."""
        state = self.workers.get(address)
        if state is None or state.status == "lost":
            return [], None
        state.status = "lost"
        running = {s: t for s, t in state.in_flight.items() if s not in self.done}
        for s in state.in_flight:
            self._unhold(s, state)
        state.in_flight.clear()
        state.late = 0.0
        self.index.refresh(state)
        blamed = min(running, key=running.__getitem__) if running and blame else None
        requeued = [s for s in running if s not in self._holders]  # not held elsewhere
        for s in requeued:
            bisect.insort(self._pending, s)
        return requeued, blamed

    def estimates(self) -> dict[str, float]:
        """Seconds per batch of the workers not lost, for ``estimates=`` of the next pass
        (including what a request still running says about its worker)."""
        return {
            w.address: w.effective_seconds
            for w in self.workers.values()
            if w.status != "lost" and w.effective_seconds
        }

    # -- batches ------------------------------------------------------------
    def add_batch(self) -> int:
        seq = self.known
        self.known += 1
        self._pending.append(seq)  # new numbers are the largest: stays sorted
        return seq

    def wants_more(self) -> bool:
        """Whether the loader should pull another batch from the sampler."""
        return not self.exhausted and self.known < self.delivered + self.window

    def holders(self, seq: int) -> list[str]:
        return [w.address for w in self._holders.get(seq, ())]

    def finished(self) -> bool:
        return self.exhausted and self.delivered >= self.known

    def pass_end(self) -> int | None:
        """The number of batches of this pass, if known yet."""
        if self.exhausted:
            return self.known
        if self.pass_length is not None:
            return max(self.pass_length, self.known)
        return None

    def _assign(self, w: WorkerState, seq: int, now: float) -> None:
        w.in_flight[seq] = now
        self._holders.setdefault(seq, []).append(w)
        self.index.refresh(w)

    def _unhold(self, seq: int, w: WorkerState) -> None:
        holders = self._holders.get(seq)
        if holders is not None and w in holders:
            holders.remove(w)
            if not holders:
                del self._holders[seq]

    # -- decisions ----------------------------------------------------------
    def next_dispatch(self, now: float | None = None) -> tuple[str, int] | None:
        """Pick (worker, seq) for the next request, or None if nothing can go now."""
        if not self._pending:
            return None
        limit = self.delivered + self.window
        if self._pending[0] >= limit:
            return None
        best = self.index.best(self.index.free_measured, self.index.free_unmeasured)
        if best is None:
            return None
        now = self._now(now)
        if self.index.late and self.index.late[0][0] < now:
            self.index.raise_late(now)
            best = self.index.best(self.index.free_measured, self.index.free_unmeasured)
            if best is None:  # raising estimates frees no credit; kept for the type checker
                return None
        mine, worker = best
        index = 0
        typical = self.typical_batch_seconds()
        if typical is not None and self.index.alive > 1:
            any_worker = self.index.best(self.index.all_measured, self.index.all_unmeasured)
            assert any_worker is not None  # more than one alive
            soonest = any_worker[0]
            total_rate = self.index.total_rate(typical)
            if mine > soonest and self._keep_for_others(worker, mine, soonest, total_rate, typical, now):
                return None
            if mine > _SLOW_RATIO * soonest:
                # Some other worker (maybe busy now) would finish the lowest batch much
                # sooner: keep it for them and give this one a batch needed later.
                target = min(self.delivered + int(total_rate * mine), limit - 1)
                if target >= self.known and not self.exhausted:
                    return None  # not pulled from the sampler yet: an earlier one would hold up the rest
                index = bisect.bisect_left(self._pending, target)
                below_limit = bisect.bisect_left(self._pending, limit)
                if index >= below_limit:
                    index = below_limit - 1
        seq = self._pending.pop(index)
        self._assign(worker, seq, now)
        self._hold_until = None
        return worker.address, seq

    def _keep_for_others(
        self, worker: WorkerState, mine: float, soonest: float, total_rate: float, typical: float, now: float
    ) -> bool:
        """End of the pass: would the others finish every remaining batch before ``worker``
        finishes one more?"""
        end = self.pass_end()
        if end is None:
            return False
        others_rate = total_rate - 1.0 / (worker.effective_seconds or typical)
        if others_rate <= 0:
            return False
        remaining = len(self._pending) + max(end - self.known, 0)
        others_queued = self.index.in_flight - len(worker.in_flight)
        others_finish = max((remaining + others_queued) / others_rate, soonest)
        if mine <= others_finish:
            return False
        if self._hold_until is None:
            self._hold_until = now + _HOLD_SLACK * others_finish
        return now < self._hold_until

    def _resize_window(self) -> None:
        typical = self.typical_batch_seconds()
        if typical is None or not self.index.alive:
            return
        slowest_queue = self.credits * self.index.times[-1]
        needed = int(self.index.total_rate(typical) * slowest_queue) + self.index.alive + self.credits
        self.window = min(max(self.base_window, needed), self.max_window)

    def completed(self, address: str, seq: int, now: float | None = None) -> tuple[bool, list[str]]:
        """Record a finished batch.

        Returns whether this result is the one to deliver (False for a late duplicate or
        an unexpected result) and the other workers still holding the batch (to cancel).
        """
        state = self.workers.get(address)
        if state is None or seq not in state.in_flight or seq in self.done:
            return False, []
        now = self._now(now)
        started = state.in_flight.pop(seq)
        state.late = 0.0
        self._unhold(seq, state)
        # time this request had the worker to itself (requests queue behind each other)
        sample = now - max(started, state.last_done)
        state.last_done = now
        state.completed += 1
        if sample > 0:
            prev = state.seconds_per_batch
            state.seconds_per_batch = sample if prev is None else (1 - _ALPHA) * prev + _ALPHA * sample
        self.done.add(seq)
        self.index.refresh(state)
        if state.completed % 8 == 1:
            self._resize_window()
        return True, self._forget(seq)

    def failed(self, address: str, seq: int) -> list[str]:
        """A request ended without a usable result (its error is delivered in order)."""
        state = self.workers.get(address)
        if state is not None and state.in_flight.pop(seq, None) is not None:
            state.late = 0.0
            self._unhold(seq, state)
            self.index.refresh(state)
        self.done.add(seq)
        return self._forget(seq)

    def _forget(self, seq: int) -> list[str]:
        others = self._holders.pop(seq, [])
        for w in others:
            del w.in_flight[seq]  # its lateness stays: it says how slow w is until w finishes something
            self.index.refresh(w)
        return [w.address for w in others]

    # -- stragglers -----------------------------------------------------------
    def typical_batch_seconds(self) -> float | None:
        """Median measured seconds per batch of the alive workers."""
        return self.index.typical()

    def hedge(self, factor: float, min_seconds: float, now: float | None = None) -> list[tuple[str, int]]:
        """Duplicate overdue batches that are needed soon onto workers with a free credit."""
        typical = self.typical_batch_seconds()
        if typical is None:
            return []
        now = self._now(now)
        self.index.raise_late(now)
        limit = max(factor * typical, min_seconds)
        horizon = min(self.delivered + max(self.index.alive, 1), self.known)
        stuck = []  # workers whose oldest request began before now - limit (exact test below)
        running = self.index.running
        while running and running[0][0] <= now - limit + 1e-9:
            entry = heapq.heappop(running)
            if entry[3] == entry[4].version:
                stuck.append(entry)
        for entry in stuck:
            heapq.heappush(running, entry)
        overdue = []
        for entry in stuck:
            holder = entry[4]
            for seq, dispatched in holder.in_flight.items():
                if (
                    self.delivered <= seq < horizon
                    and seq not in self.hedged
                    and seq not in self.done
                    and len(self._holders.get(seq, ())) == 1
                    and now - max(dispatched, holder.last_done) > limit
                ):  # requests run one after another
                    overdue.append((seq, holder))
        out = []
        for seq, holder in sorted(overdue, key=lambda item: item[0]):
            best = self.index.best(self.index.free_measured, self.index.free_unmeasured, exclude=holder)
            if best is None:
                break
            target = best[1]
            self._assign(target, seq, now)
            self.hedged.add(seq)
            out.append((target.address, seq))
        return out

    # -- batches loaded ahead (the previous pass prefetched them) ----------------------
    def has_pending(self) -> bool:
        """Whether some added batch waits to be dispatched."""
        return bool(self._pending)

    def preloaded(self, seq: int) -> None:
        """Batch ``seq`` (just added) already has its result."""
        self._remove_pending(seq)
        self.done.add(seq)

    def adopt(self, address: str, started: float, seq: int) -> bool:
        """Batch ``seq`` (just added) is already running on ``address`` since ``started``.

        Returns False (and leaves it pending) when that worker does not serve this pass.
        """
        state = self.workers.get(address)
        if state is None or not state.alive:
            return False
        self._remove_pending(seq)
        self._assign(state, seq, started)
        return True

    def _remove_pending(self, seq: int) -> None:
        i = bisect.bisect_left(self._pending, seq)
        if i < len(self._pending) and self._pending[i] == seq:
            del self._pending[i]

    def take_delivered(self) -> None:
        self.done.discard(self.delivered)
        self.hedged.discard(self.delivered)
        self.delivered += 1
