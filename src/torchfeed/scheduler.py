"""Which batch goes to which worker, and when.

Pure bookkeeping, no I/O, so it can be tested alone. The loader feeds it batch
sequence numbers, asks it for dispatch decisions and reports completions and lost
workers.

* **Credits.** A worker holds at most ``credits`` requests (the loader's
  ``prefetch_factor``); a finished request returns its credit at once.
* **Least loaded first.** Among workers with a free credit, the one whose queue
  would drain soonest (in-flight count times its measured time per batch) is served.
* **Look-ahead for slow workers.** Batches are delivered in order, so a slow worker
  given the *next* batch would hold up every later one. A worker is instead given the
  batch that will be needed about when it can finish it, estimated from the measured
  rates; the batches it skips go to faster workers. With no measurements yet every
  worker takes the lowest pending batch.
* **Window.** No batch beyond ``delivered + window`` is dispatched, which bounds the
  memory held by results waiting for an earlier batch. Once rates are measured the
  window widens (up to ``max_window``) to cover what the other workers deliver while the
  slowest one works through its queue, so its look-ahead batches are not clamped.
* **Loss.** The batches of a lost worker return to the pending set, where they are the
  lowest and so are dispatched first. The oldest of them (the one the worker was most
  likely executing) is blamed; a batch blamed for too many deaths is a poison batch.
* **Draining.** A worker being removed gets no new batches; its in-flight ones finish.
* **Hedging.** A batch needed soon that has been running much longer than the typical
  batch is duplicated on a worker with a free credit; the first result wins and the
  other request is cancelled.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

_ALPHA = 0.3  # weight of the newest sample in the per-worker time estimate
_SLOW_RATIO = 1.5  # a worker this much slower than the best one skips ahead


@dataclass
class WorkerState:
    address: str
    in_flight: Dict[int, float] = field(default_factory=dict)  # seq -> dispatch time
    seconds_per_batch: Optional[float] = None
    last_done: float = 0.0
    completed: int = 0
    status: str = "alive"  # alive | draining | lost

    @property
    def alive(self) -> bool:
        return self.status == "alive"


class Scheduler:
    def __init__(self, workers: Iterable[str], credits: int, window: int, max_window: Optional[int] = None):
        if credits < 1:
            raise ValueError("credits must be >= 1")
        self.credits = credits
        self.base_window = self.window = max(window, 1)
        self.max_window = max(max_window or 4 * self.base_window, self.base_window)
        self.workers: Dict[str, WorkerState] = {}
        for w in workers:
            self.add_worker(w)
        self._pending: List[int] = []  # sorted sequence numbers not yet dispatched
        self.known = 0  # batches 0..known-1 have been added
        self.exhausted = False  # no more batches will be added
        self.delivered = 0  # batches below this were handed to the consumer
        self.done: Set[int] = set()  # completed, not yet delivered
        self.losses: Dict[int, int] = {}  # seq -> worker deaths blamed on it
        self.hedged: Set[int] = set()  # seqs that were duplicated once

    # -- membership ---------------------------------------------------------
    def add_worker(self, address: str) -> None:
        state = self.workers.get(address)
        if state is None or state.status == "lost":
            self.workers[address] = WorkerState(address)
        else:
            state.status = "alive"

    def alive_workers(self) -> List[str]:
        return [w.address for w in self.workers.values() if w.alive]

    def serving_workers(self) -> List[str]:
        """Workers that are alive or still finishing their batches."""
        return [w.address for w in self.workers.values() if w.status != "lost"]

    def drain_worker(self, address: str) -> None:
        state = self.workers.get(address)
        if state is not None and state.status == "alive":
            state.status = "draining"

    def worker_lost(self, address: str) -> Tuple[List[int], Optional[int]]:
        """Mark a worker dead. Return its batches now pending again, and the blamed one."""
        state = self.workers.get(address)
        if state is None or state.status == "lost":
            return [], None
        state.status = "lost"
        running = {s: t for s, t in state.in_flight.items() if s not in self.done}
        state.in_flight.clear()
        blamed = min(running, key=running.get) if running else None
        if blamed is not None:
            self.losses[blamed] = self.losses.get(blamed, 0) + 1
        held_elsewhere = {s for w in self.workers.values() for s in w.in_flight}
        requeued = [s for s in running if s not in held_elsewhere]
        for s in requeued:
            bisect.insort(self._pending, s)
        return requeued, blamed

    # -- batches ------------------------------------------------------------
    def add_batch(self) -> int:
        seq = self.known
        self.known += 1
        self._pending.append(seq)  # new numbers are the largest: stays sorted
        return seq

    def wants_more(self) -> bool:
        """Whether the loader should pull another batch from the sampler."""
        return not self.exhausted and self.known < self.delivered + self.window

    def holders(self, seq: int) -> List[str]:
        return [w.address for w in self.workers.values() if seq in w.in_flight]

    def finished(self) -> bool:
        return self.exhausted and self.delivered >= self.known

    # -- decisions ----------------------------------------------------------
    def _rate(self, w: WorkerState) -> Optional[float]:
        return None if not w.seconds_per_batch else 1.0 / w.seconds_per_batch

    def next_dispatch(self, now: Optional[float] = None) -> Optional[Tuple[str, int]]:
        """Pick (worker, seq) for the next request, or None if nothing can go now."""
        if not self._pending:
            return None
        limit = self.delivered + self.window
        if self._pending[0] >= limit:
            return None
        alive = [w for w in self.workers.values() if w.alive]
        free = [w for w in alive if len(w.in_flight) < self.credits]
        if not free:
            return None
        measured = all(w.seconds_per_batch for w in alive)

        def drain_time(w: WorkerState) -> float:
            """When a batch queued on w now would be done (relative)."""
            return (len(w.in_flight) + 1) * (w.seconds_per_batch if measured else 1.0)

        worker = min(free, key=drain_time)
        index = 0
        if measured and len(alive) > 1:
            # Some other worker (maybe busy now) would finish the lowest batch much
            # sooner: keep it for them and give this one a batch needed later.
            soonest = min(drain_time(w) for w in alive)
            mine = drain_time(worker)
            if mine > _SLOW_RATIO * soonest:
                total_rate = sum(1.0 / w.seconds_per_batch for w in alive)
                target = min(self.delivered + int(total_rate * mine), limit - 1)
                index = bisect.bisect_left(self._pending, target)
                below_limit = bisect.bisect_left(self._pending, limit)
                if index >= below_limit:
                    index = below_limit - 1
        seq = self._pending.pop(index)
        worker.in_flight[seq] = time.monotonic() if now is None else now
        return worker.address, seq

    def _resize_window(self) -> None:
        alive = [w for w in self.workers.values() if w.alive]
        if not alive or not all(w.seconds_per_batch for w in alive):
            return
        total_rate = sum(1.0 / w.seconds_per_batch for w in alive)
        slowest_queue = self.credits * max(w.seconds_per_batch for w in alive)
        needed = int(total_rate * slowest_queue) + len(alive) + self.credits
        self.window = min(max(self.base_window, needed), self.max_window)

    def completed(self, address: str, seq: int, now: Optional[float] = None) -> Tuple[bool, List[str]]:
        """Record a finished batch.

        Returns whether this result is the one to deliver (False for a late duplicate or
        an unexpected result) and the other workers still holding the batch (to cancel).
        """
        now = time.monotonic() if now is None else now
        state = self.workers.get(address)
        if state is None or seq not in state.in_flight or seq in self.done:
            return False, []
        started = state.in_flight.pop(seq)
        # time this request had the worker to itself (requests queue behind each other)
        sample = now - max(started, state.last_done)
        state.last_done = now
        state.completed += 1
        if sample > 0:
            prev = state.seconds_per_batch
            state.seconds_per_batch = sample if prev is None else (1 - _ALPHA) * prev + _ALPHA * sample
        self.done.add(seq)
        if state.completed % 8 == 1:
            self._resize_window()
        return True, self._forget(seq)

    def failed(self, address: str, seq: int) -> List[str]:
        """A request ended without a usable result (its error is delivered in order)."""
        state = self.workers.get(address)
        if state is not None:
            state.in_flight.pop(seq, None)
        self.done.add(seq)
        return self._forget(seq)

    def _forget(self, seq: int) -> List[str]:
        others = []
        for w in self.workers.values():
            if w.in_flight.pop(seq, None) is not None:
                others.append(w.address)
        return others

    # -- stragglers -----------------------------------------------------------
    def typical_batch_seconds(self) -> Optional[float]:
        times = sorted(w.seconds_per_batch for w in self.workers.values()
                       if w.alive and w.seconds_per_batch)
        return times[len(times) // 2] if times else None

    def hedge(self, factor: float, min_seconds: float, now: Optional[float] = None) -> List[Tuple[str, int]]:
        """Duplicate overdue batches that are needed soon onto workers with a free credit."""
        typical = self.typical_batch_seconds()
        if typical is None:
            return []
        now = time.monotonic() if now is None else now
        limit = max(factor * typical, min_seconds)
        out = []
        horizon = self.delivered + max(len(self.alive_workers()), 1)
        for seq in range(self.delivered, min(horizon, self.known)):
            if seq in self.done or seq in self.hedged:
                continue
            holders = [w for w in self.workers.values() if seq in w.in_flight]
            if len(holders) != 1:
                continue
            holder = holders[0]
            began = max(holder.in_flight[seq], holder.last_done)  # requests run one after another
            if now - began <= limit:
                continue
            free = [w for w in self.workers.values()
                    if w.alive and w is not holder and len(w.in_flight) < self.credits]
            if not free:
                break
            target = min(free, key=lambda w: (len(w.in_flight), w.seconds_per_batch or typical))
            target.in_flight[seq] = now
            self.hedged.add(seq)
            out.append((target.address, seq))
        return out

    def take_delivered(self) -> None:
        self.done.discard(self.delivered)
        self.delivered += 1
