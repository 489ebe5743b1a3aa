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
  memory held by results waiting for an earlier batch.
* **Loss.** The batches of a lost worker return to the pending set, where they are the
  lowest and so are dispatched first.
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
    alive: bool = True


class Scheduler:
    def __init__(self, workers: Iterable[str], credits: int, window: int):
        if credits < 1:
            raise ValueError("credits must be >= 1")
        self.credits = credits
        self.window = max(window, 1)
        self.workers: Dict[str, WorkerState] = {}
        for w in workers:
            self.add_worker(w)
        self._pending: List[int] = []  # sorted sequence numbers not yet dispatched
        self.known = 0  # batches 0..known-1 have been added
        self.exhausted = False  # no more batches will be added
        self.delivered = 0  # batches below this were handed to the consumer
        self.done: Set[int] = set()  # completed, not yet delivered

    # -- membership ---------------------------------------------------------
    def add_worker(self, address: str) -> None:
        state = self.workers.get(address)
        if state is None or not state.alive:
            self.workers[address] = WorkerState(address)

    def alive_workers(self) -> List[str]:
        return [w.address for w in self.workers.values() if w.alive]

    def worker_lost(self, address: str) -> List[int]:
        """Mark a worker dead; return its in-flight batches, now pending again."""
        state = self.workers.get(address)
        if state is None or not state.alive:
            return []
        state.alive = False
        seqs = [s for s in state.in_flight if s not in self.done]
        state.in_flight.clear()
        for s in seqs:
            bisect.insort(self._pending, s)
        return seqs

    # -- batches ------------------------------------------------------------
    def add_batch(self) -> int:
        seq = self.known
        self.known += 1
        self._pending.append(seq)  # new numbers are the largest: stays sorted
        return seq

    def wants_more(self) -> bool:
        """Whether the loader should pull another batch from the sampler."""
        return not self.exhausted and self.known < self.delivered + self.window

    def pending_count(self) -> int:
        return len(self._pending)

    def outstanding(self) -> int:
        return sum(len(w.in_flight) for w in self.workers.values())

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

    def completed(self, address: str, seq: int, now: Optional[float] = None) -> bool:
        """Record a finished batch; False if it was not expected from this worker."""
        now = time.monotonic() if now is None else now
        state = self.workers.get(address)
        if state is None or seq not in state.in_flight:
            return False
        started = state.in_flight.pop(seq)
        # time this request had the worker to itself (requests queue behind each other)
        sample = now - max(started, state.last_done)
        state.last_done = now
        state.completed += 1
        if sample > 0:
            prev = state.seconds_per_batch
            state.seconds_per_batch = sample if prev is None else (1 - _ALPHA) * prev + _ALPHA * sample
        self.done.add(seq)
        return True

    def failed(self, address: str, seq: int) -> None:
        """A request ended without a usable result (its error is delivered in order)."""
        state = self.workers.get(address)
        if state is not None:
            state.in_flight.pop(seq, None)
        self.done.add(seq)

    def take_delivered(self) -> None:
        self.done.discard(self.delivered)
        self.delivered += 1
