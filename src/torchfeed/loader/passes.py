"""One pass of a RemoteDataLoader over a map-style dataset: dispatch, failures, in-order delivery.

The sampler runs in the trainer; batches of keys go to workers (least loaded first, see
:mod:`torchfeed.loader.scheduler`), which load and collate them; collated batches stream back
straight into their final (optionally pinned) memory and are yielded in sampler order.
Reader threads report results; everything the user should hear about is emitted from
the user's thread, at the user's line (:mod:`torchfeed.notices`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from ..errors import RemoteError, TorchfeedError, WorkerLost
from ..util import weak_callback
from . import plan as passplan
from . import split
from .basepass import POLL_SECONDS, Delivery, Pass
from .ledger import Ledger
from .plan import BatchRequests, PassPlan, new_pass_id
from .prefetch import Head, Loaded, Miss
from .views import keys_of

log = logging.getLogger("torchfeed.loader")

_JOIN_SECONDS = 1.0  # how long close() waits for the dispatch thread to end


# NOTE [threads of a map-style pass]
#
# A MapPass involves these threads (torch's dataloader.py documents its own the same way):
#
# * the consumer (the user's thread): ``iter(loader)`` builds the pass and pulls the
#   first window of batches from the sampler (as torch's iterator does, so samplers that
#   draw from torch's global generator draw at the same point); ``__next__`` waits for
#   the next batch in order, takes it and hands it to the user (basepass.py). It never
#   sends a batch's request or cancel; once the pass delivered its last batch, it reads a
#   cached dataset's figures from the workers (``PassObserver.finished``, passstats.py).
# * one dispatch thread per pass (``torchfeed-dispatch``): everything that decides or
#   sends: later pulls from the sampler, scheduler decisions, hedges, requests and
#   cancellations to workers, and (at the end of a pass) the prediction and prefetch of
#   the next pass's first batches (:mod:`torchfeed.loader.prefetch`). It owns the sampler
#   iterator once the pass is built.
# * connection reader threads (one per worker connection, client/connection.py): receive replies
#   into their buffers and call ``on_result`` (the pass is a ``prefetch.ResultSink``),
#   which only records the outcome in the scheduler and the ledger (ledger.py), and
#   wakes the consumer and the dispatch thread. No user code and no send runs on them.
# * the keeper thread of the connections' Session (session.py: heartbeats, deadlines)
#   and a dataset's membership thread (loader/dataset.py: the pass is its
#   ``MembershipListener``), which only record and wake, as reader threads do.
#
# Locks, in the order they may be taken (never the reverse):
#   the pass's _lock (the scheduler, the ledger, flags; shared by the two
#      conditions ``_ready``, where the consumer waits, and ``_work``, where the
#      dispatch thread waits)
#   -> prefetch.Head._lock (the prefetched batches of the next pass: taken by the next
#      pass while it claims them; released before calling into any pass)
#   -> a connection's _pending_lock (taken and released inside RemoteRef.request/cancel).
# A connection's _send_lock is only ever taken with none of these held: every send and
# cancel runs on a dispatch thread (or in close()) after the pass lock is released. A
# reader thread holds no lock of its connection while it calls ``on_result``. Samplers
# are used by one thread at a time: the consumer until the dispatch thread starts, then
# that thread; the next pass's prediction works on copies (fresh generators).


class MapPass(Pass):
    """One pass over a map-style dataset. See the NOTE above for its threads and locks."""

    def __init__(self, plan: PassPlan, head: Head | None = None):
        super().__init__(plan)
        self._auto = plan.auto_collation
        self._head = head if head is not None and head.matches(plan) else None
        if head is not None and self._head is None:
            head.discard()
        self._pass_id = self._head.pass_id if self._head is not None else new_pass_id()
        self._work = threading.Condition(self._lock)  # the dispatch thread waits here
        self._dirty = False  # the dispatch thread has something to do
        self._ledger = Ledger(self._auto)  # keys, results, requests and cancels of each batch
        self._requests = BatchRequests.of(plan, self._pass_id)
        self._predicted = False  # whether the next pass's first batches were predicted
        self._next_head: Head | None = None  # their prefetch, if they could be
        self.prefetched = 0  # batches of this pass loaded by the previous one
        self._parts = 1  # scheduler batches the first batch was cut into (loader/split.py)
        workers = self._source.alive_workers()
        failed = plan.fetchers.ensure(workers)
        for w, exc in failed.items():
            self._faults.unreachable(w, exc)
        workers = [w for w in workers if w not in failed]
        self._sched = passplan.scheduler(plan, workers)
        self._stats.started(workers, self.inflight)
        self._source.subscribe(self)
        self._track()
        with self._lock:
            if not workers:
                self._faults.none_left(announce=True)
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
                if self._sched.known == 0 and self._head is None and self._config.split_first:
                    self._add_split(idx)
                    continue
                seq = self._sched.add_batch()
                self._ledger.indices[seq] = idx
                if self._head is not None:
                    self._adopt(self._head, seq, idx)
            if exhausted:
                self._sched.exhausted = True
                self._ready.notify()

    def _add_split(self, idx) -> None:
        """Add the pass's first batch as one part per serving worker (lock held)."""
        alive = sum(1 for w in self._sched.workers.values() if w.status == "alive")
        parts = split.parts_of(idx, alive)
        for part in parts:
            self._ledger.indices[self._sched.add_batch()] = part
        self._parts = len(parts)
        if self._sched.pass_length is not None:
            self._sched.pass_length += len(parts) - 1

    def _take_first(self) -> Delivery | None:
        """The first batch, once every part of it is here: one delivery (lock held)."""
        if any(seq not in self._ledger.results for seq in range(self._parts)):
            return None
        taken = [self._ledger.take(seq) for seq in range(self._parts)]
        keys = [key for t in taken if t is not None for key in t.keys]
        samples = sum(t.samples for t in taken if t is not None)
        failed = next((t for t in taken if t is not None and not t.ok), None)
        for _ in taken:
            self._sched.take_delivered()
        self._parts = 1
        if failed is not None:  # the batch failed: it names all of its samples, as unsplit
            error = failed.value.with_indices(keys) if isinstance(failed.value, RemoteError) else failed.value
            return Delivery(False, error, samples, keys)
        try:
            value = split.join([t.value for t in taken if t is not None])
        except Exception as exc:  # noqa: BLE001 - the batch fails in its turn, with the reason
            return Delivery(False, exc, samples, keys)
        return Delivery(True, value, samples, keys)

    def _adopt(self, head: Head, seq: int, idx) -> None:
        """Use the prefetched copy of batch ``seq`` if it loads the same keys (lock held)."""
        claim = head.adopt(seq, idx, self, self._sched, self._ledger)
        if claim is None:  # used up, or this pass differs from the prediction
            self._head = None
            return
        self.prefetched += not isinstance(claim, Miss)
        if isinstance(claim, Loaded) and claim.outcome.ok:
            self._stats.preloaded(claim.address, len(keys_of(idx, self._auto)), claim.nbytes)

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
        sends: list[tuple[str, int, Any]] = []  # (address, seq, keys) of each request to send
        with self._lock:
            if self._closed:
                return
            if self._fatal is None:  # a poison batch must not go out again
                config = self._config
                overdue = passplan.hedges(
                    sched, config.straggler_factor, config.straggler_min_seconds, self._stats
                )
                for address, seq in overdue:
                    sends.append((address, seq, self._ledger.indices.get(seq)))
                while (choice := sched.next_dispatch()) is not None:
                    address, seq = choice
                    sends.append((address, seq, self._ledger.indices.get(seq)))
            cancels = self._ledger.take_cancels()
            more = sched.wants_more() and self._fatal is None
            dispatched_all = sched.exhausted and not sched.has_pending()
            predict = not self._predicted and self._fatal is None and dispatched_all
            if predict:
                self._predicted = True  # decided once per pass
            head = self._next_head
            room = passplan.prefetch_room(sched) if head is not None else None
        for address, seq, idx in sends:
            self._send(address, seq, idx)
        self._send_cancels(cancels)
        if predict:
            head = self._plan.next_head(self) if self._plan.next_head is not None else None
            with self._lock:
                self._next_head = head
                room = passplan.prefetch_room(sched) if head is not None else None
        if head is not None and room is not None and room.free:
            head.waker = self._poke
            head.fill(room.free, room.busy, room.loading)
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

    def _send(self, address: str, seq: int, idx) -> None:
        """Send one request (dispatch thread, no lock held)."""
        try:
            rid = self._requests.send(address, idx, weak_callback(self.on_result, address, seq))
        except (WorkerLost, OSError, KeyError) as exc:
            with self._lock:
                self._lose_worker(address, exc)
            return
        except Exception as exc:  # a key the view cannot map: that batch fails, in order
            with self._lock:
                if seq not in self._sched.done and seq >= self._sched.delivered:
                    self._ledger.settle(seq, False, exc, self._sched.failed(address, seq))
                    self._ready.notify()
            return
        with self._lock:
            if self._closed:
                self._ledger.cancel(address, rid)
            elif address in self._sched.holders(seq):  # else: answered (or given up) already
                self._ledger.sent(seq, address, rid)

    def _send_cancels(self, cancels: dict[str, list[int]]) -> None:
        """Tell workers to drop these requests (no lock held)."""
        for address, rids in cancels.items():
            fetcher = self._plan.fetchers.get(address)
            if rids and fetcher is not None:
                fetcher.cancel(rids)

    def _lose_worker(self, address: str, exc: BaseException) -> None:
        """A worker is gone (lock held): its batches go back to the others (loader/faults.py decides the rest)."""
        state = self._sched.workers.get(address)
        if state is None or state.status == "lost":
            return  # every pending request of a dead connection reports it: act once
        requeued, blamed = self._sched.worker_lost(address, blame=not passplan.quiet(exc))
        for seq in requeued:
            self._ledger.requests.get(seq, {}).pop(address, None)
        was_quiet = self._faults.lost(address, exc, len(requeued))
        if blamed is not None:
            poison = self._faults.blame(blamed, address, f"batch {blamed}", self._ledger.keys(blamed))
            self._fatal = self._fatal or poison
        if not self._sched.serving_workers():
            self._faults.none_left(announce=not was_quiet and not self._sched.finished())
        self._ready.notify()
        self._wake()

    # -- membership changes (from the datasets' threads) -----------------------------------
    def _joined(self, address: str) -> None:
        self._sched.add_worker(address)
        self._wake()
        self._ready.notify()

    def _removed(self, address: str) -> None:
        self._sched.drain_worker(address)
        self._wake()
        self._ready.notify()

    # -- reader threads: record and wake, nothing else --------------------------------------
    def on_result(self, address: str, seq: int, ok: bool, value: Any) -> None:
        """A reply (or failure) for batch ``seq`` from ``address`` (:class:`prefetch.ResultSink`)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._record(address, seq, ok, value)
            except Exception as exc:  # noqa: BLE001 - a bug here must not leave the batch unsettled
                log.exception(
                    "torchfeed: the result of batch %d from worker %s could not be recorded", seq, address
                )
                self._settle_broken(address, seq, ok, value, exc)
            self._wake()  # a credit is free

    def _record(self, address: str, seq: int, ok: bool, value: Any) -> None:
        """Record a result (lock held): the scheduler's and the ledger's books."""
        if not ok and isinstance(value, WorkerLost):
            self._lose_worker(address, value)
            return
        if ok:
            accepted, others = self._sched.completed(address, seq)
            if accepted:  # where the reply's size is known (client.reply_bytes)
                state = self._sched.workers.get(address)
                spb = state.seconds_per_batch if state is not None else None
                self._stats.reply(address, len(self._ledger.keys(seq)), spb, whole=not 0 < seq < self._parts)
        else:
            accepted = seq not in self._sched.done and seq >= self._sched.delivered
            others = self._sched.failed(address, seq) if accepted else []
            if accepted and isinstance(value, RemoteError):
                value = value.with_indices(self._ledger.keys(seq))
        if accepted:
            self._ledger.settle(seq, ok, value, others)
            if seq == self._sched.delivered or seq < self._parts:  # a part of the first batch
                self._ready.notify()

    def _settle_broken(self, address: str, seq: int, ok: bool, value: Any, exc: Exception) -> None:
        """Recording batch ``seq``'s result failed (lock held): the batch fails in its turn with
        the worker's error if it was one, else with ``exc``, rather than never arriving."""
        if seq < self._sched.delivered or seq in self._ledger.results:
            return  # delivered or settled already
        if ok or not isinstance(value, BaseException):
            error: BaseException = TorchfeedError(
                f"torchfeed could not record the result of batch {seq} from worker {address}: {exc!r} "
                "(a bug in torchfeed: please report it)"
            )
            error.__cause__ = exc
        else:
            error = value
        try:
            others = self._sched.failed(address, seq)
        except Exception:  # noqa: BLE001 - the batch is settled even if the books are not
            others = []
        self._ledger.settle(seq, False, error, others)
        self._ready.notify()

    # -- consumer (basepass.Pass.__next__ waits; these look, lock held) --------------------
    def _poll(self) -> Delivery | None:
        sched = self._sched
        seq = sched.delivered
        if self._parts > 1 and seq == 0:
            taken = self._take_first()
        else:
            taken = self._ledger.take(seq)
            if taken is not None:
                sched.take_delivered()
        if taken is not None:
            self._plan.progress.handed(taken.samples, taken.keys)
            if sched.known >= seq + sched.window:  # the window held the dispatch back
                self._wake()
            return taken
        if self._fatal is not None:
            self._fail(self._fatal)
        if sched.finished():
            self._end()
        return None

    def _late(self) -> BaseException:
        seq = self._sched.delivered
        return passplan.late_error(seq, self._ledger.keys(seq), self._timeout, self._sched.holders(seq))

    # -- shutdown ------------------------------------------------------------------
    def _closing(self) -> None:
        if self._plan.on_estimates is not None:
            self._plan.on_estimates(self._sched.estimates())
        self._ledger.close()
        if self._head is not None:  # batches of the prefetch this pass has not reached
            self._ledger.cancel_all(self._head.take_cancels())
            self._head = None
        self._work.notify()  # the dispatch thread sends the cancels and ends

    def close(self) -> None:
        """Stop this pass: outstanding requests are cancelled."""
        super().close()
        with self._lock:
            cancels = self._ledger.take_cancels()
        self._send_cancels(cancels)
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread() and thread.is_alive():
            thread.join(_JOIN_SECONDS)  # it was woken by the close: it ends at once (or after a send)

    def _dispatch_failed(self, exc: BaseException) -> None:
        """The dispatch thread failed with ``exc`` (the sampler's error, or ours): the consumer raises it."""
        with self._lock:
            self._fatal = self._fatal or exc
            self._ready.notify()


def _dispatch_loop(ref: weakref.ref[MapPass], work: threading.Condition) -> None:
    """The dispatch thread of a pass (holds the pass only while it works, so an abandoned
    pass is still collected and closed)."""
    while True:
        it = ref()
        if it is None:
            return
        with work:
            if it.closed:
                cancels = it._ledger.take_cancels()
                closed = True
            else:
                closed = False
                if not it._dirty:
                    del it
                    work.wait(POLL_SECONDS)  # also the period of the straggler checks
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
            it._dispatch_failed(exc)
        del it
