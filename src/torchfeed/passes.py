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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import client, events, notices
from .errors import ConnectionClosed, PoisonSampleError, RemoteError, Timeout, WorkerLost
from .remote_dataset import wait_all
from .scheduler import Scheduler
from .views import Source, keys_of

log = logging.getLogger("torchfeed.loader")

_POLL = 0.05  # seconds between straggler checks while the consumer waits
_JOIN_SECONDS = 1.0  # how long close() waits for the dispatch thread to end
_STALL_DEFAULT = 120.0  # seconds to wait for a worker when none is left and timeout=0
_pass_ids = itertools.count(1)
_live: weakref.WeakSet = weakref.WeakSet()  # passes not closed yet
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
        self._refs: dict[str, client.RemoteRef] = {}
        self._lock = threading.Lock()

    def ensure(self, workers: Sequence[str]) -> dict[str, BaseException]:
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

    def get(self, address: str) -> client.RemoteRef | None:
        return self._refs.get(address)


@dataclass
class PassPlan:
    """What the loader hands a pass: where the indices come from and how to load them."""

    source: Source
    fetchers: FetcherSet
    sampler_iter: Any
    progress: Any  # resume.Progress
    auto_collation: bool
    sample_seed: int | None  # per-sample seeding's base seed, None when off
    base_seed: int  # the pass's base seed (worker seeds are base_seed + id, as in torch)
    stats: Any = None  # stats.Accounting of the loader [stats hook]


# NOTE [threads of a map-style pass]
#
# A MapPass involves these threads (torch's dataloader.py documents its own the same way):
#
# * the consumer (the user's thread): ``iter(loader)`` builds the pass and pulls the
#   first window of batches from the sampler (as torch's iterator does, so samplers that
#   draw from torch's global generator draw at the same point); ``__next__`` waits for
#   the next batch in order, takes it and hands it to the user. It never sends.
# * one dispatch thread per pass (``torchfeed-dispatch``): everything that decides or
#   sends: later pulls from the sampler, scheduler decisions, hedges, requests and
#   cancellations to workers, and (at the end of a pass) the prediction and prefetch of
#   the next pass's first batches (:mod:`torchfeed.prefetch`). It owns the sampler
#   iterator once the pass is built.
# * connection reader threads (one per worker connection, client.py): receive replies
#   into their buffers and call ``_on_result``, which only records the outcome in the
#   scheduler and the results, and wakes the consumer and the dispatch thread. No user
#   code (sampler, collate, callbacks) and no send runs on them.
# * the keeper thread (client.py: heartbeats, deadlines) and a dataset's membership
#   thread (remote_dataset.py: ``worker_joined``/``worker_removed``), which only record
#   and wake the dispatch thread, as reader threads do.
#
# Locks, in the order they may be taken (never the reverse):
#   MapPass._lock (the scheduler, results, request ids, flags; shared by the two
#      conditions ``_ready``, where the consumer waits, and ``_work``, where the
#      dispatch thread waits)
#   -> prefetch.Head._lock (the prefetched batches of the next pass: taken by the next
#      pass while it claims them; released before calling into any pass)
#   -> client.Connection._pending_lock (taken and released inside request/cancel).
# A connection's _send_lock is only ever taken with none of these held: every send and
# cancel runs on a dispatch thread (or in close()) after the pass lock is released. A
# reader thread holds no lock of its connection while it calls ``_on_result``. Samplers
# are used by one thread at a time: the consumer until the dispatch thread starts, then
# that thread; the next pass's prediction works on copies (fresh generators).


class MapPass:
    """One pass over a map-style dataset. See the NOTE above for its threads and locks."""

    def __init__(self, loader, plan: PassPlan, head=None):
        self._loader = loader
        self._plan = plan
        self._source = plan.source
        self._auto = plan.auto_collation
        self._pin = loader.pin_memory
        self._timeout = loader.timeout
        self._head = head if head is not None and head.matches(plan, self._pin) else None
        if head is not None and self._head is None:
            head.discard()
        self._pass_id = self._head.pass_id if self._head is not None else new_pass_id()
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)  # the consumer waits here
        self._work = threading.Condition(self._lock)  # the dispatch thread waits here
        self._dirty = False  # the dispatch thread has something to do
        self._notices = notices.Pending()
        self._indices: dict[int, Any] = {}
        self._results: dict[int, tuple] = {}
        self._requests: dict[int, dict[str, int]] = {}  # seq -> {address: request id}
        self._to_cancel: dict[str, list[int]] = {}  # sent by the dispatch thread
        self._errors: dict[str, str] = {}
        self._fatal: BaseException | None = None
        self._closed = False
        self._stalled_since: float | None = None  # when the last serving worker was lost
        self._next_head = None  # the next pass's prefetch, started by this pass
        self.prefetched = 0  # batches of this pass loaded by the previous one
        workers = self._source.alive_workers()
        failed = plan.fetchers.ensure(workers)
        for w, exc in failed.items():
            self._errors[w] = repr(exc)
            self._source.worker_lost(w, exc)
            events.worker_unreachable(w, exc)
        workers = [w for w in workers if w not in failed]
        credits = pipeline_depth(
            loader.prefetch_factor,
            getattr(loader, "_estimates", None),
            plan.stats.mean_batch_bytes() if plan.stats is not None else None,
        )
        # reorder slack beyond the credits, so one slow worker does not stall the rest
        n = max(len(workers), len(self._source.workers), 1)
        self._sched = Scheduler(
            workers,
            credits=credits,
            window=max(2 * credits * n, n + 2 * credits),
            pass_length=_pass_length(loader, plan.progress),
            estimates=getattr(loader, "_estimates", None),
        )
        self._acc = plan.stats  # [stats hook] O(1) counters per batch, see stats.py
        self._last_samples = 0
        if self._acc is not None:
            self._acc.pass_started(workers, self.inflight)
        self._source.subscribe(self)
        _live.add(self)
        with self._lock:
            if not workers:
                self._no_worker_left()
        # the first window is pulled here, on the consumer thread (torch pulls its first
        # batches in iter() too); the dispatch thread sends them and pulls the rest
        self._pull(self._sched.window)
        self._thread = threading.Thread(
            target=_dispatch_loop,
            args=(weakref.ref(self), self._work),
            name=f"torchfeed-dispatch-{self._pass_id}",
            daemon=True,
        )
        with self._lock:
            self._wake()
        self._thread.start()
        self._notices.emit()

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def _stall_limit(self) -> float:
        return self._timeout or _STALL_DEFAULT

    def _poke(self) -> None:
        """Wake the dispatch thread from a thread that holds no pass lock."""
        with self._lock:
            self._wake()

    def _wake(self) -> None:
        """Give the dispatch thread work (called with the lock held)."""
        if not self._dirty:
            self._dirty = True
            self._work.notify()

    # -- the sampler (consumer thread while building, then the dispatch thread) ----------
    def _pull(self, count: int) -> None:
        """Pull up to ``count`` batches of keys from the sampler (no pass lock held)."""
        batches = []
        exhausted = False
        for _ in range(count):
            try:
                batches.append(next(self._plan.sampler_iter))
            except StopIteration:
                exhausted = True
                break
        with self._lock:
            for idx in batches:
                seq = self._sched.add_batch()
                self._indices[seq] = idx
                if self._head is not None:
                    self._adopt(seq, idx)
            if exhausted:
                self._sched.exhausted = True
                self._ready.notify()

    def _adopt(self, seq: int, idx) -> None:
        """Use the prefetched copy of batch ``seq`` if it loads the same keys (lock held)."""
        claim = self._head.claim(seq, idx, self)
        if claim is None:  # used up, or this pass differs from the prediction
            self._merge_cancels(self._head.take_cancels())
            self._head = None
            return
        if claim[0] != "miss":
            self.prefetched += 1
        if claim[0] == "done":
            self._sched.preloaded(seq)
            self._results[seq] = claim[2]
            if claim[2][0] and self._acc is not None:  # [stats hook] loaded by the previous pass
                self._acc.delivered(claim[1], len(keys_of(idx, self._auto)), 0, None)
        elif claim[0] == "running":
            address, (rid, started) = claim[1], claim[2]
            if self._sched.adopt(address, started, seq):
                self._requests.setdefault(seq, {})[address] = rid
            else:  # its worker does not serve this pass: sent again as usual
                released = self._head.release(seq)
                if released is not None:
                    self._to_cancel.setdefault(released[0], []).append(released[1])

    def _merge_cancels(self, cancels: dict[str, list[int]]) -> None:
        for address, rids in cancels.items():
            self._to_cancel.setdefault(address, []).extend(rids)

    # -- the dispatch thread ---------------------------------------------------------------
    def _pump(self) -> None:
        """One round of the dispatch thread: pull, decide, then send with no lock held."""
        with self._lock:
            self._dirty = False
            if self._closed:
                return
            sched = self._sched
            want = (
                0
                if sched.exhausted or self._fatal is not None
                else max(sched.delivered + sched.window - sched.known, 0)
            )
        if want:
            self._pull(want)
        sends: list[tuple] = []
        with self._lock:
            if self._closed:
                return
            if self._fatal is None:  # a poison batch must not go out again
                for address, seq in self._hedges():
                    sends.append((address, seq, self._indices.get(seq)))
                while True:
                    choice = sched.next_dispatch()
                    if choice is None:
                        break
                    sends.append((*choice, self._indices.get(choice[1])))
            cancels, self._to_cancel = self._to_cancel, {}
            more = sched.wants_more() and self._fatal is None
            if (
                self._next_head is None
                and self._fatal is None
                and sched.exhausted
                and not sched.has_pending()
            ):
                self._next_head = False  # decided once per pass
                predict = True
            else:
                predict = False
            head = self._next_head or None
            free = self._free_credits() if head is not None else None
        for address, seq, idx in sends:
            self._send(address, seq, idx)
        self._send_cancels(cancels)
        if predict:
            head = self._loader._prefetch_next(self)
            with self._lock:
                self._next_head = head or False
                free = self._free_credits() if head else None
        if head and free:
            head.waker = self._poke
            head.fill(free)
        if more:  # the window allows more pulls (a head's results wake this thread themselves)
            with self._lock:
                self._wake()

    def prefetch_count(self) -> int:
        """How many of the next pass's batches to load ahead (at most): four rounds of every
        worker's credits; in practice the free credits of the pass's tail take fewer."""
        return self._sched.credits * max(len(self._sched.workers), 1) * 4

    def estimates(self) -> dict[str, float]:
        with self._lock:
            return self._sched.estimates()

    def inflight(self) -> dict[str, int]:
        """Requests each worker holds now (read without the lock: a snapshot for stats)."""
        return {a: len(w.in_flight) for a, w in list(self._sched.workers.items())}

    def _free_credits(self) -> dict[str, int]:
        """Credits this pass leaves unused, per worker (for the next pass's prefetch)."""
        return {
            w.address: self._sched.credits - len(w.in_flight)
            for w in self._sched.workers.values()
            if w.alive and len(w.in_flight) < self._sched.credits
        }

    def _hedges(self) -> list[tuple]:
        factor = self._loader.straggler_factor
        if factor is None:
            return []
        out = self._sched.hedge(factor, self._loader.straggler_min_seconds)
        for address, seq in out:  # [stats hook] an event and a count for the slow worker
            slow = next((h for h in self._sched.holders(seq) if h != address), "?")
            events.batch_hedged(seq, slow, address)
            if self._acc is not None:
                self._acc.hedged(slow)
        return out

    def _send(self, address: str, seq: int, idx) -> None:
        """Send one request (dispatch thread, no lock held)."""
        this = weakref.ref(self)

        def on_result(ok, value, _seq=seq, _address=address):
            it = this()
            if it is not None:
                it._on_result(_address, _seq, ok, value)

        try:
            fetcher = self._plan.fetchers.get(address)
            if fetcher is None:
                raise WorkerLost(f"no fetcher on worker {address}")
            keys = self._source.map_index(idx, self._auto)
            worker_id, num_workers = self._source.worker_id(address)
            context = (self._pass_id, worker_id, num_workers, self._plan.base_seed)
            rid = fetcher.request((keys, self._plan.sample_seed, context), callback=on_result, pin=self._pin)
        except (WorkerLost, OSError, KeyError) as exc:
            with self._lock:
                self._lose_worker(address, exc)
            return
        except Exception as exc:  # a key the view cannot map: that batch fails, in order
            with self._lock:
                if seq not in self._sched.done and seq >= self._sched.delivered:
                    self._results[seq] = (False, exc)
                    self._add_cancels(self._sched.failed(address, seq), self._requests.pop(seq, {}))
                    self._ready.notify()
            return
        with self._lock:
            if self._closed:
                self._to_cancel.setdefault(address, []).append(rid)
            elif address in self._sched.holders(seq):  # else: answered (or given up) already
                self._requests.setdefault(seq, {})[address] = rid

    def _add_cancels(self, others: list[str], requests: dict[str, int]) -> None:
        for a in others:
            rid = requests.get(a)
            if rid is not None:
                self._to_cancel.setdefault(a, []).append(rid)

    def _send_cancels(self, cancels: dict[str, list[int]]) -> None:
        """Tell workers to drop these requests (no lock held)."""
        for address, rids in cancels.items():
            fetcher = self._plan.fetchers.get(address)
            if rids and fetcher is not None:
                fetcher.cancel(rids)

    def _quiet(self, exc: BaseException) -> bool:
        return _exiting or sys.is_finalizing() or isinstance(exc, ConnectionClosed)

    def _lose_worker(self, address: str, exc: BaseException) -> None:
        """A worker is gone (lock held)."""
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
        else:  # [stats hook] an event (logged), no warning: nothing to change in code
            events.worker_lost(address, exc, len(requeued))
        if self._acc is not None:
            self._acc.requeued(address, len(requeued))
        if blamed is not None and self._sched.losses.get(blamed, 0) > self._loader.max_retries:
            indices = keys_of(self._indices.get(blamed), self._auto)
            self._fatal = PoisonSampleError(
                f"loading samples {_short(indices)} (batch {blamed}) killed {self._sched.losses[blamed]} worker "
                f"processes in a row (the last: {address}); giving up after max_retries="
                f"{self._loader.max_retries}. Fix or exclude these samples.",
                indices,
                [address],
            )
            events.poison(str(self._fatal))
        if not self._sched.serving_workers() and self._stalled_since is None:
            self._no_worker_left(quiet=self._quiet(exc))
        self._ready.notify()
        self._wake()

    def _no_worker_left(self, quiet: bool = False) -> None:
        self._stalled_since = time.monotonic()
        if quiet or self._sched.finished():
            return
        lost = ", ".join(self._errors) or ", ".join(self._source.workers)
        events.no_worker_left(lost, self._stall_limit())

    # -- membership changes (from the datasets' threads) -----------------------------------
    def worker_joined(self, address: str) -> None:
        if self._closed or address not in self._source.alive_workers():
            return
        failed = self._plan.fetchers.ensure([address])
        if failed:
            return
        with self._lock:
            if self._closed:
                return
            self._sched.add_worker(address)
            self._stalled_since = None
            self._wake()
            self._ready.notify()

    def worker_removed(self, address: str) -> None:
        if self._acc is not None:
            self._acc.draining(address)
        with self._lock:
            self._sched.drain_worker(address)
            self._wake()
            self._ready.notify()

    # -- reader threads: record and wake, nothing else --------------------------------------
    def _on_result(self, address: str, seq: int, ok: bool, value: Any) -> None:
        with self._lock:
            if self._closed:
                return
            if not ok and isinstance(value, WorkerLost):
                self._lose_worker(address, value)
                return
            if ok:
                accepted, others = self._sched.completed(address, seq)
                if accepted and self._acc is not None:  # [stats hook] counters only
                    state = self._sched.workers.get(address)
                    self._acc.delivered(
                        address,
                        len(keys_of(self._indices.get(seq), self._auto)),
                        client.reply_bytes(),
                        state.seconds_per_batch if state is not None else None,
                    )
            else:
                accepted = seq not in self._sched.done and seq >= self._sched.delivered
                others = self._sched.failed(address, seq) if accepted else []
                if accepted and isinstance(value, RemoteError):
                    value = value.with_indices(keys_of(self._indices.get(seq), self._auto))
            if accepted:
                self._results[seq] = (ok, value)
                self._add_cancels(others, self._requests.pop(seq, {}))
                if seq == self._sched.delivered:
                    self._ready.notify()
            self._wake()  # a credit is free

    # -- consumer ------------------------------------------------------------------
    def __next__(self):
        acc = self._acc
        entered = acc.enter() if acc is not None else 0.0  # [stats hook]
        ok = None
        try:
            ok, value = self._next_result()
        except (StopIteration, KeyboardInterrupt):
            self.close()  # after Ctrl-C nothing more is loaded or reported
            raise
        finally:
            self._notices.emit()
            events.flush()
            if acc is not None and ok is None:
                acc.left()
        if acc is not None:
            acc.consumed(entered, self._last_samples)
        if not ok:
            raise value
        return value

    def _next_result(self) -> tuple:
        deadline = time.monotonic() + self._timeout if self._timeout else None
        with self._lock:
            while True:
                if self._closed:
                    raise StopIteration
                sched = self._sched
                seq = sched.delivered
                if seq in self._results:
                    result = self._results.pop(seq)
                    self._plan.progress.batches += 1
                    self._last_samples = len(keys_of(self._indices.pop(seq, None), self._auto))
                    self._plan.progress.samples += self._last_samples
                    sched.take_delivered()
                    if sched.known >= seq + sched.window:  # the window held the dispatch back
                        self._wake()
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
                if stalled and (
                    now - self._stalled_since > self._stall_limit()
                    or (deadline is not None and now >= deadline)
                ):
                    self._close_locked()
                    raise WorkerLost(
                        f"no worker is left (waited {now - self._stalled_since:.1f} s for one "
                        "to come back or join): " + "; ".join(f"{w}: {e}" for w, e in self._errors.items()),
                        self._errors,
                    )
                if deadline is not None and now >= deadline:
                    holders = ", ".join(sched.holders(seq)) or "no worker (not dispatched yet)"
                    raise Timeout(
                        f"batch {seq} (indices {_short(keys_of(self._indices.get(seq), self._auto))}) did not arrive "
                        f"within timeout={self._timeout:g} s; it is held by {holders}"
                    )
                self._lock.release()  # warnings noticed meanwhile are emitted while waiting
                try:
                    self._notices.emit()
                    events.flush()
                finally:
                    self._lock.acquire()
                wait = _POLL if deadline is None else min(_POLL, deadline - now)
                self._ready.wait(wait)

    # -- shutdown ------------------------------------------------------------------
    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        self._loader._estimates = self._sched.estimates()
        for requests in self._requests.values():
            for address, rid in requests.items():
                self._to_cancel.setdefault(address, []).append(rid)
        self._requests.clear()
        self._results.clear()
        if self._head is not None:  # batches of the prefetch this pass has not reached
            self._merge_cancels(self._head.take_cancels())
            self._head = None
        self._work.notify()  # the dispatch thread sends the cancels and ends

    def close(self) -> None:
        """Stop this pass: outstanding requests are cancelled."""
        with self._lock:
            self._close_locked()
            cancels, self._to_cancel = self._to_cancel, {}
        self._send_cancels(cancels)
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(_JOIN_SECONDS)  # it was woken by the close: it ends at once (or after a send)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# Small, fast batches: more requests in flight per worker than prefetch_factor (see
# pipeline_depth). Bounds: at most this many bytes per batch and seconds per batch.
SMALL_BATCH_BYTES = 256 * 1024
FAST_BATCH_SECONDS = 0.005


def pipeline_depth(prefetch_factor: int, estimates: dict | None, mean_batch_bytes: float | None) -> int:
    """Requests in flight per worker for the next pass.

    ``prefetch_factor`` (torch's meaning: batches loaded ahead per worker), except for
    batches the previous passes measured as small (<= SMALL_BATCH_BYTES on average) and
    fast (the fastest worker takes < FAST_BATCH_SECONDS each): then twice as many. Such
    batches are bound by the round trip, not by the worker: with only ``prefetch_factor``
    requests queued, a worker finishes them before the next request reaches it and idles
    (more so across a real network than on loopback). The memory this holds is at most
    a few MB (small batches), and the order of the batches does not change.
    """
    if not estimates or not mean_batch_bytes:
        return prefetch_factor
    if mean_batch_bytes <= SMALL_BATCH_BYTES and min(estimates.values()) < FAST_BATCH_SECONDS:
        return 2 * prefetch_factor
    return prefetch_factor


def _pass_length(loader, progress) -> int | None:
    """Batches this pass will load, when the sampler says (fewer after a resume)."""
    try:
        return max(len(loader) - progress.batches, 0)
    except TypeError:
        return None


def _dispatch_loop(ref: weakref.ref[MapPass], work: threading.Condition) -> None:
    """The dispatch thread of a pass (holds the pass only while it works, so an abandoned
    pass is still collected and closed)."""
    while True:
        it = ref()
        if it is None:
            return
        with work:
            if it._closed:
                cancels, it._to_cancel = it._to_cancel, {}
                closed = True
            else:
                closed = False
                if not it._dirty:
                    del it
                    work.wait(_POLL)  # also the period of the straggler checks
                    it = ref()
                    if it is None:
                        return
        if closed:
            try:
                it._send_cancels(cancels)
            except Exception:  # noqa: BLE001 - closing: a failed cancel only means the worker is gone
                log.debug("torchfeed dispatch thread: cancel on close", exc_info=True)
            return
        try:
            it._pump()
        except Exception as exc:  # noqa: BLE001 - the sampler's own error (or ours) reaches the user
            log.debug("torchfeed dispatch thread", exc_info=True)
            with work:
                it._fatal = it._fatal or exc
                it._ready.notify()
        del it


def _short(items: list[Any]) -> str:
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"
