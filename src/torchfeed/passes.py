"""One pass of a RemoteDataLoader over a map-style dataset: dispatch, failures, in-order delivery.

The sampler runs in the trainer; batches of keys go to workers (least loaded first, see
:mod:`torchfeed.scheduler`), which load and collate them; collated batches stream back
straight into their final (optionally pinned) memory and are yielded in sampler order.
Reader threads report results; everything the user should hear about is emitted from
the user's thread, at the user's line (:mod:`torchfeed.notices`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import client, notices
from .errors import ConnectionClosed, PoisonSampleError, RemoteError, Timeout, WorkerLost
from .remote_dataset import wait_all
from .scheduler import Scheduler
from .views import Source, keys_of

log = logging.getLogger("torchfeed.loader")

_POLL = 0.05  # seconds between straggler checks while the consumer waits
_STALL_DEFAULT = 120.0  # seconds to wait for a worker when none is left and timeout=0
_pass_ids = itertools.count(1)
_live: "weakref.WeakSet" = weakref.WeakSet()  # passes not closed yet
_exiting = False


def _close_all_passes() -> None:
    """At interpreter exit, before connections close: passes go quiet (no 'lost worker' noise)."""
    global _exiting
    _exiting = True
    for p in list(_live):
        try:
            p.close()
        except Exception:
            pass


atexit.register(_close_all_passes)  # registered after client's close_all: runs before it


def new_pass_id() -> int:
    return next(_pass_ids)


class FetcherSet:
    """One loader's worker-side objects (made by ``make(address)``), one per worker."""

    def __init__(self, make: Callable[[str], Any], timeout: float, secret):
        self._make = make
        self._timeout = timeout
        self._secret = secret
        self._refs: Dict[str, client.RemoteRef] = {}
        self._lock = threading.Lock()

    def ensure(self, workers: Sequence[str]) -> Dict[str, BaseException]:
        """Create the fetchers not made yet (or lost with their connection); return the failures."""
        with self._lock:
            missing = [w for w in workers if w not in self._refs or self._refs[w].closed]
            if not missing:
                return {}
            futs = {w: self._make(w) for w in missing}
            failed = {}
            for w, v in wait_all(futs, self._timeout).items():
                if isinstance(v, RemoteError):
                    raise v
                if isinstance(v, BaseException):
                    failed[w] = v
                else:
                    self._refs[w] = v
            return failed

    def get(self, address: str) -> Optional[client.RemoteRef]:
        return self._refs.get(address)


@dataclass
class PassPlan:
    """What the loader hands a pass: where the indices come from and how to load them."""

    source: Source
    fetchers: FetcherSet
    sampler_iter: Any
    progress: Any  # resume.Progress
    auto_collation: bool
    sample_seed: Optional[int]  # per-sample seeding's base seed, None when off
    base_seed: int  # the pass's base seed (worker seeds are base_seed + id, as in torch)


class MapPass:
    """One pass over a map-style dataset. Thread-safe against the connection reader threads."""

    def __init__(self, loader, plan: PassPlan):
        self._loader = loader
        self._plan = plan
        self._source = plan.source
        self._auto = plan.auto_collation
        self._pin = loader.pin_memory
        self._timeout = loader.timeout
        self._pass_id = new_pass_id()
        self._cond = threading.Condition(threading.RLock())
        self._notices = notices.Pending()
        self._indices: Dict[int, Any] = {}
        self._results: Dict[int, tuple] = {}
        self._requests: Dict[int, Dict[str, int]] = {}  # seq -> {address: request id}
        self._errors: Dict[str, str] = {}
        self._fatal: Optional[BaseException] = None
        self._closed = False
        self._stalled_since: Optional[float] = None  # when the last serving worker was lost
        workers = self._source.alive_workers()
        failed = plan.fetchers.ensure(workers)
        for w, exc in failed.items():
            self._errors[w] = repr(exc)
            self._source.worker_lost(w, exc)
            self._notices.add(f"torchfeed: worker {w} is unreachable and is skipped for now: {exc}")
        workers = [w for w in workers if w not in failed]
        credits = loader.prefetch_factor
        # reorder slack beyond the credits, so one slow worker does not stall the rest
        n = max(len(workers), len(self._source.workers), 1)
        self._sched = Scheduler(workers, credits=credits, window=max(2 * credits * n, n + 2 * credits))
        self._source.subscribe(self)
        _live.add(self)
        with self._cond:
            if not workers:
                self._no_worker_left()
            self._dispatch()
        self._notices.emit()

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def _stall_limit(self) -> float:
        return self._timeout or _STALL_DEFAULT

    # -- dispatch (called with the lock held) ---------------------------------
    def _dispatch(self) -> None:
        sched = self._sched
        while not self._closed and self._fatal is None:  # a poison batch must not go out again
            while sched.wants_more():
                try:
                    idx = next(self._plan.sampler_iter)
                except StopIteration:
                    sched.exhausted = True
                    break
                self._indices[sched.add_batch()] = idx
            choice = sched.next_dispatch()
            if choice is None:
                return
            self._send(*choice)

    def _hedge(self) -> None:
        factor = self._loader.straggler_factor
        if factor is None or self._closed or self._fatal is not None:
            return
        for address, seq in self._sched.hedge(factor, self._loader.straggler_min_seconds):
            log.info("batch %d is overdue; duplicating it on %s", seq, address)
            self._send(address, seq)

    def _send(self, address: str, seq: int) -> None:
        this = weakref.ref(self)

        def on_result(ok, value, _seq=seq, _address=address):
            it = this()
            if it is not None:
                it._on_result(_address, _seq, ok, value)

        try:
            fetcher = self._plan.fetchers.get(address)
            if fetcher is None:
                raise WorkerLost(f"no fetcher on worker {address}")
            keys = self._source.map_index(self._indices[seq], self._auto)
            worker_id, num_workers = self._source.worker_id(address)
            context = (self._pass_id, worker_id, num_workers, self._plan.base_seed)
            rid = fetcher.request((keys, self._plan.sample_seed, context), callback=on_result, pin=self._pin)
        except (WorkerLost, OSError, KeyError) as exc:
            self._lose_worker(address, exc)
            return
        except Exception as exc:  # a key the view cannot map: that batch fails, in order
            self._results[seq] = (False, exc)
            self._sched.failed(address, seq)
            return
        self._requests.setdefault(seq, {})[address] = rid

    def _quiet(self, exc: BaseException) -> bool:
        return _exiting or sys.is_finalizing() or isinstance(exc, ConnectionClosed)

    def _lose_worker(self, address: str, exc: BaseException) -> None:
        state = self._sched.workers.get(address)
        if state is None or state.status == "lost":
            return  # every pending request of a dead connection reports it: act once
        requeued, blamed = self._sched.worker_lost(address)
        self._errors[address] = repr(exc)
        self._source.worker_lost(address, exc)
        for seq in requeued:
            self._requests.get(seq, {}).pop(address, None)
        if self._quiet(exc):
            log.info("connection to worker %s closed by this process", address)
        else:
            self._notices.add(f"torchfeed: lost worker {address} ({exc}); its {len(requeued)} batch(es) go to "
                              "the other workers")
        if blamed is not None and self._sched.losses.get(blamed, 0) > self._loader.max_retries:
            indices = keys_of(self._indices.get(blamed), self._auto)
            self._fatal = PoisonSampleError(
                f"loading samples {_short(indices)} (batch {blamed}) killed {self._sched.losses[blamed]} worker "
                f"processes in a row (the last: {address}); giving up after max_retries="
                f"{self._loader.max_retries}. Fix or exclude these samples.", indices, [address])
        if not self._sched.serving_workers() and self._stalled_since is None:
            self._no_worker_left(quiet=self._quiet(exc))

    def _no_worker_left(self, quiet: bool = False) -> None:
        self._stalled_since = time.monotonic()
        if quiet or self._sched.finished():
            return
        lost = ", ".join(self._errors) or ", ".join(self._source.workers)
        self._notices.add(f"torchfeed: no worker is left to load from (lost: {lost}); waiting up to "
                          f"{self._stall_limit():g} s (the loader's timeout) for one to come back or join, "
                          "then WorkerLost is raised")

    # -- membership changes (from the datasets) -----------------------------------------
    def worker_joined(self, address: str) -> None:
        if self._closed or address not in self._source.alive_workers():
            return
        failed = self._plan.fetchers.ensure([address])
        if failed:
            return
        with self._cond:
            if self._closed:
                return
            self._sched.add_worker(address)
            self._stalled_since = None
            self._dispatch()
            self._cond.notify_all()

    def worker_removed(self, address: str) -> None:
        with self._cond:
            self._sched.drain_worker(address)
            self._cond.notify_all()

    # -- reader threads ------------------------------------------------------------
    def _on_result(self, address: str, seq: int, ok: bool, value: Any) -> None:
        with self._cond:
            if self._closed:
                return
            if not ok and isinstance(value, WorkerLost):
                self._lose_worker(address, value)
            else:
                if ok:
                    accepted, others = self._sched.completed(address, seq)
                else:
                    accepted = seq not in self._sched.done
                    others = self._sched.failed(address, seq) if accepted else []
                    if isinstance(value, RemoteError):
                        value = value.with_indices(keys_of(self._indices.get(seq), self._auto))
                requests = self._requests.pop(seq, {}) if accepted else {}
                if accepted:
                    self._results[seq] = (ok, value)
                self._cancel({a: requests[a] for a in others if a in requests})
            self._hedge()  # a freed credit goes to an overdue batch before new work
            self._dispatch()
            self._cond.notify_all()

    def _cancel(self, requests: Dict[str, int]) -> None:
        for address, rid in requests.items():
            fetcher = self._plan.fetchers.get(address)
            if fetcher is not None:
                fetcher.cancel([rid])

    # -- consumer ------------------------------------------------------------------
    def __next__(self):
        try:
            ok, value = self._next_result()
        except (StopIteration, KeyboardInterrupt):
            self.close()  # after Ctrl-C nothing more is loaded or reported
            raise
        finally:
            self._notices.emit()
        if not ok:
            raise value
        return value

    def _next_result(self) -> tuple:
        deadline = time.monotonic() + self._timeout if self._timeout else None
        with self._cond:
            while True:
                if self._closed:
                    raise StopIteration
                sched = self._sched
                seq = sched.delivered
                if seq in self._results:
                    result = self._results.pop(seq)
                    self._plan.progress.batches += 1
                    self._plan.progress.samples += len(keys_of(self._indices.pop(seq, None), self._auto))
                    sched.take_delivered()
                    self._dispatch()
                    return result
                if self._fatal is not None:
                    self._close_locked()
                    raise self._fatal
                if sched.finished():
                    self._plan.progress.finished = True
                    self._close_locked()
                    raise StopIteration
                now = time.monotonic()
                stalled = self._stalled_since is not None
                if stalled and (now - self._stalled_since > self._stall_limit()
                                or (deadline is not None and now >= deadline)):
                    self._close_locked()
                    raise WorkerLost(f"no worker is left (waited {now - self._stalled_since:.1f} s for one "
                                     "to come back or join): "
                                     + "; ".join(f"{w}: {e}" for w, e in self._errors.items()), self._errors)
                if deadline is not None and now >= deadline:
                    holders = ", ".join(sched.holders(seq)) or "no worker (not dispatched yet)"
                    raise Timeout(f"batch {seq} (indices {_short(keys_of(self._indices.get(seq), self._auto))}) did not arrive "
                                  f"within timeout={self._timeout:g} s; it is held by {holders}")
                self._hedge()
                self._cond.release()  # warnings noticed meanwhile are emitted while waiting
                try:
                    self._notices.emit()
                finally:
                    self._cond.acquire()
                wait = _POLL if deadline is None else min(_POLL, deadline - now)
                self._cond.wait(wait)

    # -- shutdown ------------------------------------------------------------------
    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        by_worker: Dict[str, list] = {}
        for requests in self._requests.values():
            for address, rid in requests.items():
                by_worker.setdefault(address, []).append(rid)
        self._requests.clear()
        self._results.clear()
        for address, rids in by_worker.items():
            fetcher = self._plan.fetchers.get(address)
            if fetcher is not None:
                fetcher.cancel(rids)

    def close(self) -> None:
        """Stop this pass: outstanding requests are cancelled."""
        with self._cond:
            self._close_locked()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _short(items: List[Any]) -> str:
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"
