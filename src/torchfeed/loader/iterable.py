"""Iterable-style datasets (``torch.utils.data.IterableDataset``) on remote workers.

As in torch's DataLoader with ``num_workers=K``: K logical *streams*; stream ``i`` runs
``iter(dataset)`` with ``get_worker_info()`` giving id ``i`` and ``num_workers`` K, forms
batches from its own items and collates them (on the worker), and the trainer yields one
batch of each stream in turn (0, 1, ..., K-1, 0, ...), skipping streams that ended. K
is the loader's ``num_workers`` (by default the number of workers of the dataset),
whatever the number of physical workers: streams are spread over the reachable workers
(:mod:`torchfeed.worker.streams` holds the worker side).

The trainer counts the batches delivered per stream. When a worker is lost, its streams
are opened again on the others at the position delivered so far: from the state sent
with the last batch for Stateful datasets, else by restarting the iterable and dropping
the batches already delivered (said once per pass). :meth:`IterablePass.snapshot` is
that bookkeeping as plain data: a new loader resumes from it (``load_state_dict``).

Dynamically sharded datasets (:class:`torchfeed.datasets.Shards`): the trainer keeps the
epoch's queue of shards and grants the next one to a stream with a request when the
stream has started every shard it was given, so fast streams take more shards. Their
batches are yielded as they come (round robin among the streams that have one ready):
the order depends on timing anyway, and a slow worker then does not hold the others.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

from .. import errors
from ..client import wait_all
from ..errors import RemoteError, Timeout, WorkerLost
from ..protocol.errordata import rebuild_remote_error
from ..util import weak_callback
from ..worker.streams import BATCH, END, ERROR, NEED, open_stream, shard_order, shard_plan
from . import reported
from .basepass import Delivery, Pass
from .plan import PassPlan, new_pass_id, quiet
from .sampling import INT63
from .streamslots import SNAPSHOT_FORMAT, StreamResult, StreamSlot, check_snapshot


class IterablePass(Pass):
    """Trainer side: one pass over an iterable-style RemoteDataset."""

    length_source = "its dataset"

    def __init__(
        self,
        plan: PassPlan,
        resume: dict | None = None,
        *,
        stream_count: int = 1,
        ranks: tuple[int, int] = (0, 1),
    ):
        super().__init__(plan)
        config = plan.config
        self._credits = config.prefetch_factor
        self._pin = config.pin_memory
        self._policy = config.reply_policy
        self._compression = config.compression
        self._lost: set[str] = set()  # workers lost and not back (their loss is said once)
        self._tickets = itertools.count()  # orders every request and stream opening this pass sends
        self._said_replay = False
        self._pass_id = new_pass_id()
        self._base_seed = plan.base_seed
        self._rank, self._ranks = ranks  # streams are numbered across the job's ranks
        if resume is not None:
            check_snapshot(resume)
            count = resume["streams"]
        else:
            count = stream_count
        self._slots = [StreamSlot(i) for i in range(count)]
        self._turn = 0
        self._queue: deque | None = None  # shards not granted yet (dynamic sharding)
        workers = self._reachable()
        self._dynamic = self._shard_setup(workers, resume)
        if resume is not None:
            self._turn = resume["turn"]
            for slot, saved in zip(self._slots, resume["slots"]):
                slot.delivered, slot.ended = saved["delivered"], saved["ended"]
                slot.state, slot.rng, slot.taken = saved["state"], saved["rng"], saved["taken"]
                slot.latest_taken = slot.taken
                slot.grants = list(saved["grants"])
        self._samples = config.batch_size or 1
        self._before_last: dict | None = None  # the snapshot before the batch last handed out
        self._stats.started(workers, self.inflight)
        with self._lock:
            for slot in self._slots:
                if not slot.ended:
                    self._open_locked(slot, workers[slot.index % len(workers)])
        self._source.subscribe(self)  # workers that join or come back take streams waiting for one
        self._track()

    # -- workers --------------------------------------------------------------------
    def inflight(self) -> dict[str, int]:
        """Requests each worker holds now (read without the lock: a snapshot for stats)."""
        out: dict[str, int] = {}
        for slot in self._slots:
            if slot.worker is not None:
                out[slot.worker] = out.get(slot.worker, 0) + slot.inflight
        return out

    def _reachable(self) -> list[str]:
        source = self._source
        alive = set(source.alive_workers())
        workers = [w for w in source.workers if w in alive and w not in self._lost]
        if not workers:
            raise WorkerLost(f"no worker of the dataset is reachable: {source.workers}")
        failed = self._plan.fetchers.ensure(workers)
        workers = [w for w in workers if w not in failed]
        if not workers:
            raise WorkerLost("could not prepare the iterable-style pass on " + ", ".join(failed), failed)
        return workers

    def _shard_setup(self, workers: list[str], resume: dict | None) -> bool:
        first = workers[0]
        got = wait_all(
            {
                first: self._source.session.rpc_async(
                    first,
                    shard_plan,
                    args=(self._plan.fetchers.get(first),),
                    timeout=self._source.timeout,
                    secret=self._source.secret,
                )
            },
            self._source.timeout,
        )[first]
        if isinstance(got, BaseException):
            raise got
        if got is None:
            return False
        if resume is not None:
            self._queue = deque(resume["queue"])
            return True
        count, shuffle, seed = reported.shard_plan(first, got)
        epoch = self._plan.progress.record.epoch
        effective = (self._base_seed if seed is None else seed) & INT63
        self._queue = deque(shard_order(count, shuffle, effective, epoch)[self._rank :: self._ranks])
        return True

    def _pick_worker(self) -> str | None:
        """The reachable worker (prepared at the start of the pass) hosting the fewest streams."""
        fetchers = self._plan.fetchers
        workers = [
            w
            for w in self._source.alive_workers()
            if w not in self._lost and (fetcher := fetchers.get(w)) is not None and not fetcher.closed
        ]
        if not workers:
            return None
        load = {w: 0 for w in workers}
        for slot in self._slots:
            if slot.worker in load and not slot.ended:
                load[slot.worker] += 1
        return min(workers, key=lambda w: load[w])

    # -- streams (lock held) ----------------------------------------------------------
    def _open_locked(self, slot: StreamSlot, worker: str) -> None:
        slot.incarnation += 1
        slot.worker, slot.ref, slot.opening, slot.inflight = worker, None, True, 0
        slot.tickets = deque([next(self._tickets)])  # the opening runs iter(dataset) there
        position = slot.delivered + slot.contiguous()
        state, rng, taken = slot.state, slot.rng, slot.taken
        if position != slot.delivered:  # batches held here: start after the last of them
            last = slot.results[position - 1]
            state, rng, taken = last.state, last.rng, last.taken
        if self._dynamic:
            slot.latest_taken = taken
        start = {
            "position": position,
            "state": state,
            "rng": rng,
            "grants": slot.grants[taken:],
            "taken": taken,
            "total": self._total(slot),
        }
        if position and state is None and not self._said_replay and slot.incarnation > 1:
            self._said_replay = True
            self._notices.add(
                f"torchfeed: stream {slot.index} of an iterable-style dataset moved to {worker}: the "
                f"dataset has no state_dict()/load_state_dict(), so it is restarted there and its "
                f"{position} batch(es) already delivered are drawn again and dropped (exact only "
                "for a deterministic iterable)"
            )
        fetcher = self._plan.fetchers.get(worker)
        count = len(self._slots)
        context = (self._pass_id, self._rank * count + slot.index, self._ranks * count, self._base_seed)
        try:
            self._source.session.call(
                worker,
                open_stream,
                args=(fetcher, context, self._config.batch_size, self._config.drop_last, start),
                rref=True,
                timeout=self._source.timeout,
                secret=self._source.secret,
                callback=weak_callback(self._on_opened, slot, slot.incarnation, worker),
            )
        except (WorkerLost, OSError) as exc:
            self._worker_lost(worker, exc)

    def _on_opened(self, slot: StreamSlot, incarnation: int, worker: str, ok: bool, value: Any) -> None:
        with self._lock:
            if self._closed or incarnation != slot.incarnation:
                if ok:
                    value.release()
                return
            slot.opening = False
            if slot.tickets:
                slot.tickets.popleft()
            if ok:
                slot.ref = value
                self._top_up(slot)
            elif isinstance(value, (WorkerLost, OSError)) and not isinstance(value, RemoteError):
                self._worker_lost(worker, value)  # (a remote OSError is the dataset's: raised)
            else:
                self._fatal = self._fatal or value
            self._ready.notify_all()

    def _worker_lost(self, worker: str, exc: BaseException) -> None:
        """Move the streams of a lost worker elsewhere (lock held); the stream whose request it was
        running is blamed (loader/faults.py: past ``max_retries`` deaths, it is poison)."""
        if worker not in self._lost:
            self._lost.add(worker)
            mine = [s for s in self._slots if s.worker == worker and not s.ended]
            was_quiet = self._faults.lost(worker, exc, len(mine))
            running = [s for s in mine if s.tickets]
            if running and not was_quiet:
                slot = min(running, key=lambda s: s.tickets[0])
                position = slot.delivered + slot.contiguous()
                what = f"batch {position} of stream {slot.index} (an iterable-style dataset)"
                self._fatal = self._fatal or self._faults.blame((slot.index, position), worker, what, [])
        for slot in self._slots:
            if slot.worker == worker and not slot.ended:
                slot.detach()
        self._place_waiting(announce=not quiet(exc))

    def _place_waiting(self, announce: bool = True) -> None:
        """Open the streams that have no worker on the reachable workers hosting the fewest (lock
        held); with none left, wait for one to come back or join (said when ``announce``)."""
        for slot in self._slots:
            if slot.worker is None and not slot.ended and self._fatal is None:
                target = self._pick_worker()
                if target is None:
                    self._faults.none_left(announce)
                    return
                self._open_locked(slot, target)

    # -- membership (basepass.Pass prepares a joining worker; these run with the lock held) --
    def _joined(self, address: str) -> None:
        """Streams waiting for a worker open there."""
        self._lost.discard(address)
        self._place_waiting()
        self._ready.notify_all()

    def _removed(self, address: str) -> None:
        """Its streams move to the others (as after a loss, with nothing blamed), or stay while
        no other worker can take them."""
        mine = [s for s in self._slots if s.worker == address and not s.ended]
        if not mine or self._pick_worker() is None:
            return
        for slot in mine:
            slot.detach()
        self._place_waiting()
        self._ready.notify_all()

    def _top_up(self, slot: StreamSlot) -> None:
        if self._closed or slot.ended or slot.ref is None or slot.worker is None:
            return  # (a slot's ref and worker are set and cleared together)
        on_result = weak_callback(self._on_result, slot, slot.incarnation)
        while slot.inflight + len(slot.results) < self._credits:
            grants = self._grant(slot)
            try:
                slot.ref.request(
                    (grants, self._total(slot)),
                    callback=on_result,
                    pin=self._pin,
                    policy=self._policy,
                    compression=self._compression,
                )
            except (WorkerLost, OSError) as exc:
                if grants and self._queue is not None:  # not sent: back to the queue
                    del slot.grants[-len(grants) :]
                    self._queue.extendleft(reversed(grants))
                self._worker_lost(slot.worker, exc)
                return
            slot.inflight += 1
            slot.tickets.append(next(self._tickets))

    def _total(self, slot: StreamSlot) -> int | None:
        """The number of shards ``slot`` gets in all, once the queue is empty (dynamic sharding)."""
        return len(slot.grants) if self._dynamic and not self._queue else None

    def _grant(self, slot: StreamSlot) -> list:
        """A shard for ``slot`` when it has started every shard it was given."""
        if not self._dynamic or not self._queue or slot.latest_taken < len(slot.grants):
            return []
        shard = self._queue.popleft()
        slot.grants.append(shard)
        return [shard]

    def _on_result(self, slot: StreamSlot, incarnation: int, ok: bool, value: Any) -> None:
        with self._lock:
            if self._closed or incarnation != slot.incarnation or slot.ended:
                return
            try:
                self._record(slot, ok, value)
            except Exception as exc:  # noqa: BLE001 - a malformed reply (or a bug) ends the pass, said
                self._fatal = self._fatal or exc
            self._ready.notify_all()

    def _record(self, slot: StreamSlot, ok: bool, value: Any) -> None:
        """A reply of ``slot``'s current incarnation (lock held)."""
        # the current incarnation has its worker (losing it starts the next incarnation)
        assert slot.worker is not None
        slot.inflight -= 1
        if slot.tickets:
            slot.tickets.popleft()  # a stream's replies come in the order of its requests
        if ok:
            number, kind, payload, state, rng, taken = reported.stream_reply(slot.worker, value)
            slot.latest_taken = max(slot.latest_taken, taken)
            if kind == NEED:  # the next request carries a shard, or says there is none left
                self._top_up(slot)
            else:
                if kind == ERROR:
                    payload = rebuild_remote_error(slot.worker, payload, policy=self._policy)
                slot.results[number] = StreamResult(kind, payload, state, rng, taken)
                if kind == BATCH:
                    self._stats.reply(slot.worker, self._samples)
                self._top_up(slot)
        elif isinstance(value, (RemoteError, errors.SerializationError)):
            self._fatal = self._fatal or value
        else:
            self._worker_lost(slot.worker, value)  # a lost connection

    # -- consumer (basepass.Pass.__next__ waits; these look, lock held) --------------------
    def _has_batch(self, slot: StreamSlot) -> bool:
        return slot.delivered in slot.results

    def _choose(self) -> StreamSlot | None:
        live = [s for s in self._slots if not s.ended]
        if not live:
            return None
        start = self._turn % len(live)
        if not self._dynamic:
            return live[start]
        for k in range(len(live)):  # any stream with a batch ready, in turn
            slot = live[(start + k) % len(live)]
            if self._has_batch(slot):
                return slot
        return live[start]

    def _poll(self) -> Delivery | None:
        while True:
            slot = self._choose()
            if slot is None:
                self._end()
            result = slot.results.pop(slot.delivered, None)
            if result is None:
                break
            live = [s for s in self._slots if not s.ended]
            before = self._snapshot_locked()  # where the pass stood if this is a batch
            slot.delivered += 1
            if result.kind == END:
                slot.ended = True
                if slot.ref is not None:
                    slot.ref.release()
                continue
            self._turn = (live.index(slot) + 1) % len(live)
            if result.kind == BATCH and result.state is not None:
                slot.state, slot.rng, slot.taken = result.state, result.rng, result.taken
            self._plan.progress.handed(self._samples)
            self._before_last = before
            self._top_up(slot)
            if result.kind == ERROR:
                raise result.payload
            return Delivery(True, result.payload, self._samples)
        if self._fatal is not None:
            self._fail(self._fatal)
        return None

    def _late(self) -> BaseException:
        slot = self._choose()
        where = (
            f"stream {slot.index} (an iterable-style dataset, on worker {slot.worker})"
            if slot
            else "a stream"
        )
        return Timeout(
            f"DataLoader timed out after {self._timeout} seconds: the next batch of {where} did not arrive"
        )

    # -- state ---------------------------------------------------------------------------
    @property
    def pass_id(self) -> int:
        return self._pass_id

    def snapshot(self, trained_only: bool = False) -> dict:
        """Plain data: what a new loader needs to yield exactly the batches not yielded yet;
        with ``trained_only``, the batch last handed out too while the consumer has not come
        back for the next (see :func:`torchfeed.loader.resume.state_of`)."""
        with self._lock:
            return self._trained_locked() if trained_only else self._snapshot_locked()

    def _trained_locked(self) -> dict:
        if not self._plan.progress.confirmed and self._before_last is not None:
            return self._before_last
        return self._snapshot_locked()

    def _snapshot_locked(self) -> dict:
        return {
            "format": SNAPSHOT_FORMAT,
            "streams": len(self._slots),
            "turn": self._turn,
            "slots": [s.snapshot() for s in self._slots],
            "queue": list(self._queue) if self._queue is not None else None,
        }

    def _closing(self) -> None:
        # a pass left early (break, del) can still be resumed: the loader keeps where it stood
        if self._plan.on_snapshot is not None:
            self._plan.on_snapshot(self._pass_id, self._snapshot_locked(), self._trained_locked())
        for slot in self._slots:
            if slot.ref is not None:
                slot.ref.release()  # requests still queued there end with an error nobody waits for
            slot.results.clear()
