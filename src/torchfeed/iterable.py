"""Iterable-style datasets (``torch.utils.data.IterableDataset``) on remote workers.

As in torch's DataLoader with ``num_workers=N``: every worker iterates its own instance
(``get_worker_info()`` in ``__iter__`` gives its id and the number of workers, to split
the data), forms batches of ``batch_size`` items from its own stream and collates them;
the trainer yields one batch of each worker in turn (worker 0, 1, ..., N-1, 0, ...),
skipping workers whose stream has ended. Worker ids are positions in the dataset's
worker list; ``num_workers`` is its length (counting only the workers reachable when the
pass starts, so that their shards cover the data).

A stream lives in one worker process: when that worker is lost mid-pass its position
is lost with it, and the pass raises :class:`~torchfeed.WorkerLost` (torch's loader
raises when a worker dies, too).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Dict, List, Optional

from . import client, errors, notices, sampling
from .context import worker_context
from .errors import RemoteError, Timeout, WorkerLost
from .remote_dataset import wait_all

_BATCH, _END, _ERROR = 0, 1, 2
_POLL = 0.05


class Stream:
    """Worker side: one pass of one worker over its instance of an IterableDataset."""

    manages_rng = True

    def __init__(self, fetcher, context: tuple, batch_size: Optional[int], drop_last: bool):
        self._fetcher = fetcher
        self._pass = fetcher.setup.enter(*context)
        self._batch_size = batch_size
        self._drop_last = drop_last
        self._lock = threading.Lock()
        self._number = 0
        self._ended = False
        with worker_context(self._pass.info):
            sampling.use(self._pass.stream)
            self._iterator = iter(self._pass.dataset)

    def __call__(self):
        """The next batch as ``(number, kind, payload)``; errors are returned, not raised."""
        with self._lock:
            number = self._number
            self._number += 1
            if self._ended:
                return number, _END, None
            try:
                with worker_context(self._pass.info):
                    sampling.use(self._pass.stream)
                    items = self._next_items()
                batch = self._fetcher.collate_fn(items)  # outside the context, as the map-style fetcher
            except StopIteration:
                self._ended = True
                return number, _END, None
            except Exception as exc:  # raised in order by the trainer; the stream may go on
                return number, _ERROR, errors.describe_exception(exc)
            return number, _BATCH, batch

    def _next_items(self):
        if self._batch_size is None:
            return next(self._iterator)
        items: List[Any] = []
        for item in self._iterator:
            items.append(item)
            if len(items) == self._batch_size:
                break
        if not items or (self._drop_last and len(items) < self._batch_size):
            raise StopIteration
        return items


def open_stream(fetcher, context: tuple, batch_size: Optional[int], drop_last: bool) -> Stream:
    """Runs on the worker: start a worker's pass (kept there as a remote reference)."""
    return Stream(fetcher, context, batch_size, drop_last)


class IterablePass:
    """Trainer side: one pass over an iterable-style RemoteDataset."""

    def __init__(self, loader, plan):
        self._loader = loader
        self._plan = plan
        self._timeout = loader.timeout
        self._credits = loader.prefetch_factor
        self._pin = loader.pin_memory
        self._cond = threading.Condition()
        self._notices = notices.Pending()
        self._closed = False
        self._error: Dict[str, BaseException] = {}  # worker -> why its stream is gone
        source = plan.source
        alive = set(source.alive_workers())
        self._workers = [w for w in source.workers if w in alive]
        if not self._workers:
            raise WorkerLost(f"no worker of the dataset is reachable: {source.workers}")
        missing = [w for w in source.workers if w not in alive]
        if missing:  # the data is split among the workers there are: ids count those
            notices.warn(f"torchfeed: worker(s) {', '.join(missing)} unreachable: this pass over an iterable-style "
                         f"dataset is split among the {len(self._workers)} others")
        failed = plan.fetchers.ensure(self._workers)
        if failed:
            raise WorkerLost("could not prepare the iterable-style pass on " + ", ".join(failed), failed)
        from .passes import new_pass_id

        pass_id = new_pass_id()
        futures = {}
        for worker_id, w in enumerate(self._workers):
            context = (pass_id, worker_id, len(self._workers), plan.base_seed)
            futures[w] = client.rpc_async(w, open_stream, args=(plan.fetchers.get(w), context, loader.batch_size,
                                                                loader.drop_last),
                                          rref=True, timeout=source.timeout, secret=source.secret)
        opened = wait_all(futures, source.timeout)
        for value in opened.values():
            if isinstance(value, BaseException):
                raise value
        self._streams: Dict[str, client.RemoteRef] = opened
        self._results: Dict[str, Dict[int, tuple]] = {w: {} for w in self._workers}
        self._next_number = {w: 0 for w in self._workers}  # the next batch to deliver per worker
        self._requested = {w: 0 for w in self._workers}
        self._ended: set = set()
        self._turn = 0
        with self._cond:
            for w in self._workers:
                self._top_up(w)

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._loader)

    # -- requests (lock held) --------------------------------------------------------
    def _top_up(self, address: str) -> None:
        if self._closed or address in self._ended or address in self._error:
            return
        this = weakref.ref(self)
        while self._requested[address] - self._next_number[address] < self._credits:
            def on_result(ok, value, _address=address):
                me = this()
                if me is not None:
                    me._on_result(_address, ok, value)

            try:
                self._streams[address].request((), callback=on_result, pin=self._pin)
            except (WorkerLost, OSError) as exc:
                self._error[address] = exc
                return
            self._requested[address] += 1

    def _on_result(self, address: str, ok: bool, value: Any) -> None:
        with self._cond:
            if self._closed:
                return
            if ok:
                number, kind, payload = value
                if kind == _ERROR:
                    payload = errors.rebuild_remote_error(address, payload)
                self._results[address][number] = (kind, payload)
            elif address not in self._error:
                self._error[address] = value  # a lost connection (or an unpicklable batch)
            self._cond.notify_all()

    # -- consumer ------------------------------------------------------------------------
    def __next__(self):
        try:
            return self._next()
        except (StopIteration, KeyboardInterrupt):
            self.close()
            raise
        finally:
            self._notices.emit()

    def _next(self):
        deadline = time.monotonic() + self._timeout if self._timeout else None
        with self._cond:
            while True:
                live = [w for w in self._workers if w not in self._ended]
                if self._closed or not live:
                    self._close_locked()
                    raise StopIteration
                address = live[self._turn % len(live)]
                number = self._next_number[address]
                result = self._results[address].pop(number, None)
                if result is not None:
                    kind, payload = result
                    self._next_number[address] += 1
                    if kind == _END:
                        self._ended.add(address)
                        continue
                    self._turn = (live.index(address) + 1) % len(live)
                    self._top_up(address)
                    if kind == _ERROR:
                        raise payload
                    return payload
                if address in self._error:
                    exc = self._error[address]
                    self._close_locked()
                    if isinstance(exc, (RemoteError, errors.SerializationError)):
                        raise exc
                    raise WorkerLost(f"worker {address} was lost during a pass over an iterable-style dataset: "
                                     f"its stream cannot continue elsewhere ({exc})", {address: repr(exc)}) from exc
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise Timeout(f"the next batch of worker {address} (an iterable-style dataset) did not arrive "
                                  f"within timeout={self._timeout:g} s")
                self._cond.wait(_POLL if deadline is None else min(_POLL, deadline - now))

    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            stream.release()  # requests still queued there end with an error nobody waits for
        self._results.clear()

    def close(self) -> None:
        with self._cond:
            self._close_locked()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
