"""Worker side of iterable-style loading: one logical stream of an IterableDataset.

A stream is what one of torch's DataLoader worker processes does for an
``IterableDataset``: ``iter(dataset)`` under ``get_worker_info()`` = (stream id, number
of streams), batching and collation of its own items. Here a stream is an object kept
on some torchfeed worker (a remote reference); one worker may host several streams, and
a stream can be opened again elsewhere at a given position:

* **Stateful** datasets (torchdata's protocol: ``state_dict()``/``load_state_dict()`` on
  the dataset, or else on the iterator ``iter(dataset)`` returns): the state is captured
  (pickled, with the stream's random generator states) after every batch and sent back
  with it; a stream opened with such a state loads it and goes on from there.
* Other iterables are restarted and the batches already delivered are drawn again and
  dropped (exact for deterministic iterables).

Dynamic shard assignment (:class:`torchfeed.datasets.Shards`): the trainer hands shards
to a stream with its requests (*grants*, kept in the stream's :class:`Inbox`); an
iterator that has used every shard it was given and may get more raises
:class:`NeedShard`, which ends the request without ending the stream.
"""

from __future__ import annotations

import itertools
import pickle
import random
import threading
from collections import deque
from typing import Any

from .. import seeding
from ..protocol import errordata
from .context import WorkerSetup, own_copy, worker_context

_ORDER_TAG = 0x5A4D  # mixed into the shard order's seed

BATCH, END, ERROR, NEED = 0, 1, 2, 3

# Python's, numpy's and torch's global generators are per process: two streams on one
# worker draw from them one at a time (each with its own states, as in torch's worker
# processes). Start more worker processes rather than more --parallel executors.
_DRAWING = threading.Lock()


class NeedShard(Exception):
    """Raised by an iterator that waits for the trainer to grant it another shard."""


class Inbox:
    """Shards granted to one stream, not yet taken by its iterator."""

    def __init__(self, grants=(), final: bool = False, taken: int = 0, total: int | None = None):
        self._grants: deque = deque(grants)
        self.taken = taken  # counted over the stream's life (it may have moved)
        # the number of grants this stream gets in all, once the trainer knows it
        self.total = taken + len(self._grants) if final else total

    @property
    def final(self) -> bool:
        """Every grant this stream will get was taken (requests may run out of order)."""
        return self.total is not None and self.taken >= self.total

    def add(self, grants, total: int | None) -> None:
        self._grants.extend(grants)
        if total is not None:
            self.total = total

    def take(self) -> Any | None:
        """The next granted shard; None when none is waiting (then see :attr:`final`)."""
        if not self._grants:
            return None
        self.taken += 1
        return self._grants.popleft()


def stateful(obj: Any) -> bool:
    """Whether ``obj`` follows torchdata's Stateful protocol."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class Stream:
    """One stream of one pass, kept on a worker; each call yields the stream's next batch.

    ``context`` is ``(pass id, stream id, number of streams, base seed)``. ``start`` is
    None for a fresh stream, else a dict: ``position`` (batches delivered so far),
    ``state`` and ``rng`` (pickled, captured with the batch at that position; None for
    iterables without state), ``grants`` (shards handed to it again), ``taken`` (grants
    its state has taken) and ``total`` (see :meth:`__call__`).
    """

    manages_rng = True

    def __init__(
        self, fetcher, context: tuple, batch_size: int | None, drop_last: bool, start: dict | None = None
    ):
        start = start or {}
        self._collate = fetcher.collate_fn
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._lock = threading.Lock()
        self._number = int(start.get("position", 0))
        self._ended = False
        self._partial: list[Any] = []  # items of a batch interrupted by NeedShard
        self._inbox = Inbox(
            start.get("grants", ()), taken=int(start.get("taken", 0)), total=start.get("total")
        )
        with _DRAWING:  # seeding takes the global generators too
            self._pass = _setup_for(fetcher, context, fresh=not self._number).enter(*context)
            with worker_context(self._pass.info):
                self._start(self._pass.dataset, start.get("state"), start.get("rng"))

    def _start(self, dataset, state: bytes | None, rng: bytes | None) -> None:
        """``iter(dataset)`` at the stream's position: from its state, else replayed."""
        seeding.use(self._pass.stream)
        if rng is not None:
            seeding.set_global_states(pickle.loads(rng))
        self._holder = dataset if stateful(dataset) else None
        if state is not None and self._holder is not None:
            self._holder.load_state_dict(pickle.loads(state))
        dynamic = getattr(dataset, "_torchfeed_dynamic_iter", None)
        self._iterator = dynamic(self._inbox) if dynamic is not None else iter(dataset)
        if self._holder is None and stateful(self._iterator):
            self._holder = self._iterator
            if state is not None:
                self._iterator.load_state_dict(pickle.loads(state))
        if state is None and self._number:
            self._replay(self._number)

    def _replay(self, batches: int) -> None:
        """Draw and drop the items of ``batches`` batches (a restarted stream without state)."""
        per_batch = 1 if self._batch_size is None else self._batch_size
        for _ in itertools.islice(self._iterator, batches * per_batch):
            pass

    def __call__(self, grants=(), total: int | None = None):
        """The next batch: ``(number, kind, payload, state, rng, taken)``; errors are returned.

        ``grants`` are shards handed to the stream; ``total``, once known, the number of
        grants it gets in all.
        """
        with self._lock:
            self._inbox.add(grants, total)
            number = self._number
            if self._ended:
                return number, END, None, None, None, self._inbox.taken
            try:
                with _DRAWING, worker_context(self._pass.info):
                    seeding.use(self._pass.stream)
                    items = self._next_items()
                    state, rng = self._capture()
                batch = self._collate(items)  # outside the context, as the map-style fetcher
            except NeedShard:
                return number, NEED, None, None, None, self._inbox.taken
            except StopIteration:
                self._ended = True
                self._number += 1
                return number, END, None, None, None, self._inbox.taken
            except Exception as exc:  # raised in order by the trainer; the stream may go on
                self._number += 1
                return number, ERROR, errordata.describe_exception(exc), None, None, self._inbox.taken
            self._number += 1
            return number, BATCH, batch, state, rng, self._inbox.taken

    def _capture(self):
        if self._holder is None:
            return None, None
        state = pickle.dumps(self._holder.state_dict(), protocol=5)
        return state, pickle.dumps(seeding.global_states(), protocol=5)

    def _next_items(self):
        if self._batch_size is None:
            return next(self._iterator)
        items = self._partial
        while len(items) < self._batch_size:
            try:
                items.append(next(self._iterator))
            except StopIteration:
                break  # NeedShard propagates with the items kept for the next call
        self._partial = []
        if not items or (self._drop_last and len(items) < self._batch_size):
            raise StopIteration
        return items


def _setup_for(fetcher, context: tuple, fresh: bool) -> WorkerSetup:
    """A setup of its own per stream (torch seeds worker i with base_seed + i).

    With persistent workers, a stream opened from its start keeps its setup between
    passes (dataset copy, generators), as torch's worker i does.
    """
    setup = fetcher.setup
    # each stream iterates a copy of its own, as each of torch's worker processes does
    # (attributes set in __iter__ or by load_state_dict stay with the stream)
    if not (setup.persistent and fresh):
        return WorkerSetup(own_copy(setup.dataset), setup.worker_init_fn, False)
    kept = fetcher.__dict__.setdefault("_stream_setups", {})
    key = (context[1], context[2])
    if key not in kept:
        kept[key] = WorkerSetup(own_copy(setup.dataset), setup.worker_init_fn, True)
    return kept[key]


def open_stream(
    fetcher, context: tuple, batch_size: int | None, drop_last: bool, start: dict | None = None
) -> Stream:
    """Runs on the worker: open a stream (kept there as a remote reference)."""
    return Stream(fetcher, context, batch_size, drop_last, start)


def shard_plan(fetcher) -> tuple | None:
    """Runs on the worker: ``(number of shards, shuffle, seed)`` for a dynamically sharded dataset."""
    plan = getattr(fetcher.setup.dataset, "_torchfeed_plan", None)
    return plan() if plan is not None else None


def shard_order(count: int, shuffle: bool, seed: int, epoch: int) -> list[tuple]:
    """The epoch's shards as ``(index, buffer seed)``, shuffled from (seed, epoch) when asked."""
    order = list(range(count))
    if shuffle:
        random.Random(seeding.mix_seed(seed, epoch, _ORDER_TAG)).shuffle(order)
    return [(i, seeding.mix_seed(seed, epoch, i) & seeding.INT63) for i in order]
