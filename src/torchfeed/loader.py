"""RemoteDataLoader: torch's DataLoader, with remote workers.

The sampler runs in the trainer; batches of indices go to workers (least loaded first,
see :mod:`torchfeed.scheduler`), which load the samples and collate them; collated
batches stream back straight into their final (optionally pinned) memory and are
yielded in sampler order.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data._utils.collate import default_collate, default_convert

from . import client, resume, wire
from .errors import PoisonSampleError, RemoteError, Timeout, WorkerLost
from .fetch import Fetcher
from .remote_dataset import RemoteDataset, wait_all
from .scheduler import Scheduler

log = logging.getLogger("torchfeed.loader")

_POLL = 0.05  # seconds between straggler checks while the consumer waits


class RemoteDataLoader:
    """Drop-in replacement for ``torch.utils.data.DataLoader`` with remote workers.

    Takes DataLoader's arguments with the same meanings and yields the same batches for
    the same sampler order. Collation runs on the workers.

    Parameters
    ----------
    dataset : RemoteDataset
        The remote dataset (or a dataset class/factory together with ``workers=``).
    batch_size, shuffle, sampler, batch_sampler, collate_fn, drop_last, generator
        As in torch's DataLoader.
    pin_memory : bool
        Receive batches directly into pinned memory (when CUDA is available).
    timeout : float
        Seconds to wait for the next batch before raising :class:`Timeout`
        (0 waits without limit; dead workers are still detected by heartbeats).
    prefetch_factor : int
        Requests in flight per worker (the worker's credits).
    seed : int, optional
        Makes loading exactly reproducible: the shuffle order comes from (seed, epoch) and
        every sample's ``__getitem__`` runs with Python's, numpy's and torch's global
        generators seeded from (seed, epoch, index). Without it a base seed is drawn from
        ``generator`` (or torch's global generator) each pass, as torch's DataLoader does,
        and samples are seeded from it.
    workers, args, kwargs
        The seed's other form: ``RemoteDataLoader(workers=[...], dataset=Cls, kwargs={...})``
        builds the :class:`RemoteDataset` itself.
    worker_init_fn : callable, optional
        Called once on every worker with its worker id before the first batch.
    max_retries : int
        A batch whose loading killed a worker process is retried on at most this many
        other workers, then :class:`PoisonSampleError` names its samples.
    straggler_factor : float or None
        A batch needed soon that runs longer than this many times the typical batch time
        (and at least ``straggler_min_seconds``) is duplicated on a worker with a free
        credit; the first result wins. ``None`` disables duplication.
    num_workers, persistent_workers, multiprocessing_context, pin_memory_device
        Accepted for compatibility and ignored: the remote workers do the loading.
    in_order : bool
        Only ``True`` (the default) is supported.
    """

    def __init__(
        self,
        dataset,
        batch_size: Optional[int] = 1,
        shuffle: Optional[bool] = None,
        sampler: Optional[Iterable] = None,
        batch_sampler: Optional[Iterable[List]] = None,
        collate_fn: Optional[Callable] = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 120,
        *,
        prefetch_factor: Optional[int] = 2,
        generator: Optional[torch.Generator] = None,
        seed: Optional[int] = None,
        worker_init_fn: Optional[Callable] = None,
        max_retries: int = 2,
        straggler_factor: Optional[float] = 4.0,
        straggler_min_seconds: float = 0.05,
        workers: Optional[Sequence[str]] = None,
        args: Sequence = (),
        kwargs: Optional[dict] = None,
        num_workers: Optional[int] = None,
        persistent_workers: bool = False,
        multiprocessing_context=None,
        pin_memory_device: str = "",
        in_order: bool = True,
    ):
        if not in_order:
            raise ValueError("in_order=False is not supported: RemoteDataLoader always delivers batches in "
                             "sampler order (slow workers are given later batches instead, so order costs "
                             "little); remove the argument")
        if not isinstance(dataset, RemoteDataset):
            if workers is None:
                raise TypeError(
                    "RemoteDataLoader needs a RemoteDataset, or workers=[...] together with a dataset "
                    f"class or factory (got {type(dataset).__name__} and no workers)"
                )
            dataset = RemoteDataset(workers, dataset, *args, **(kwargs or {}))
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        if prefetch_factor is None:
            prefetch_factor = 2
        if prefetch_factor < 0:
            raise ValueError("prefetch_factor option should be non-negative")
        if prefetch_factor == 0:
            raise ValueError("prefetch_factor must be at least 1 with remote workers (it is the number "
                             "of requests each worker holds)")
        if sampler is not None and shuffle:
            raise ValueError("sampler option is mutually exclusive with shuffle")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, "
                                 "sampler, and drop_last")
            batch_size = None
            drop_last = False
        elif batch_size is None and drop_last:
            raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive "
                             "with drop_last")
        if seed is not None and generator is not None:
            raise ValueError("give seed= or generator=, not both: with seed the shuffle order and every "
                             "sample's random draws come from (seed, epoch)")
        self._shuffle_generator: Optional[torch.Generator] = None
        if sampler is None:
            if shuffle:
                if seed is not None:  # reseeded from (seed, epoch) at the start of every pass
                    self._shuffle_generator = torch.Generator()
                sampler = RandomSampler(dataset, generator=self._shuffle_generator or generator)
            else:
                sampler = SequentialSampler(dataset)
        if batch_size is not None and batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)

        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        self.seed = seed
        self.max_retries = max_retries
        self.straggler_factor = straggler_factor
        self.straggler_min_seconds = straggler_min_seconds
        self.pin_memory = pin_memory
        self.timeout = timeout
        self.prefetch_factor = prefetch_factor
        self.worker_init_fn = worker_init_fn
        self.in_order = in_order
        self.num_workers = num_workers
        if collate_fn is None:
            collate_fn = default_collate if self._auto_collation else default_convert
        self.collate_fn = collate_fn
        self._fetchers: Dict[str, client.RemoteRef] = {}
        self._fetchers_lock = threading.Lock()
        self._epoch = 0  # epoch of the next pass
        self._progress: Optional[resume.Progress] = None  # the latest pass
        self._resume_from: Optional[dict] = None

    # -- epochs, state and resume -------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Epoch of the next pass (it then advances by one per pass), like DistributedSampler."""
        self._epoch = int(epoch)

    @property
    def epoch(self) -> int:
        """Epoch of the next pass."""
        return self._epoch

    def state_dict(self) -> dict:
        """Where loading stands: small plain data to store in a checkpoint.

        Loaded into a new loader (same dataset, sampler settings and seed; any workers),
        the next pass yields exactly the batches this pass had not yet yielded.
        """
        return resume.state_of(self._progress, self._epoch, self.seed)

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next pass continues where that one stopped."""
        resume._check(state, self)
        self._epoch = state["epoch"]
        self._resume_from = state if state["active"] else None

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self):
        return self.batch_sampler if self._auto_collation else self.sampler

    def __len__(self) -> int:
        return len(self._index_sampler)

    def __iter__(self) -> "_RemoteLoaderIter":
        return _RemoteLoaderIter(self)

    # -- per-worker setup ----------------------------------------------------
    def _ensure_fetchers(self, workers: Sequence[str]) -> Dict[str, BaseException]:
        """Create the worker-side fetchers not made yet; return the workers that failed."""
        ds = self.dataset
        with self._fetchers_lock:
            missing = [w for w in workers
                       if w not in self._fetchers or self._fetchers[w]._conn.closed]
            if not missing:
                return {}
            futs = {}
            for i, w in enumerate(missing):
                if self.worker_init_fn is not None:  # a new fetcher: a new or restarted worker
                    wid = ds.workers.index(w) if w in ds.workers else i
                    client.rpc_async(w, self.worker_init_fn, args=(wid,), timeout=ds.timeout,
                                     secret=ds.secret).wait()
                futs[w] = client.rpc_async(w, Fetcher, args=(ds.ref(w), self.collate_fn, self._auto_collation),
                                           rref=True, timeout=ds.timeout, secret=ds.secret)
            failed = {}
            for w, v in wait_all(futs, ds.timeout).items():
                if isinstance(v, RemoteError):
                    raise v
                if isinstance(v, BaseException):
                    failed[w] = v
                else:
                    self._fetchers[w] = v
            return failed


class _RemoteLoaderIter:
    """One pass over the loader. Thread-safe against the connection reader threads."""

    def __init__(self, loader: RemoteDataLoader):
        self._loader = loader
        self._dataset = loader.dataset
        self._pin = loader.pin_memory
        self._timeout = loader.timeout
        self._cond = threading.Condition(threading.RLock())
        resume_from, loader._resume_from = loader._resume_from, None
        self._sampler_iter, self._progress = resume.begin_pass(loader, loader._epoch, resume_from)
        loader._epoch = self._progress.record.epoch + 1
        loader._progress = self._progress
        self._seed = self._progress.record.base_seed
        self._indices: Dict[int, Any] = {}
        self._results: Dict[int, tuple] = {}
        self._requests: Dict[int, Dict[str, int]] = {}  # seq -> {address: request id}
        self._errors: Dict[str, str] = {}
        self._fatal: Optional[BaseException] = None
        self._closed = False
        self._stalled_since: Optional[float] = None  # when the last serving worker was lost
        workers = self._dataset.alive_workers()
        failed = loader._ensure_fetchers(workers)
        for w, exc in failed.items():
            self._errors[w] = repr(exc)
            self._dataset.worker_lost(w, exc)
            warnings.warn(f"torchfeed: worker {w} is unreachable and is skipped for now: {exc}", stacklevel=3)
        workers = [w for w in workers if w not in failed]
        credits = loader.prefetch_factor
        # reorder slack beyond the credits, so one slow worker does not stall the rest
        n = max(len(workers), len(self._dataset.workers), 1)
        self._sched = Scheduler(workers, credits=credits, window=max(2 * credits * n, n + 2 * credits))
        self._dataset._subscribe(self)
        with self._cond:
            if not workers:
                self._stalled_since = time.monotonic()
            self._dispatch()

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return len(self._loader)

    # -- dispatch (called with the lock held) ---------------------------------
    def _dispatch(self) -> None:
        sched = self._sched
        while not self._closed and self._fatal is None:  # a poison batch must not go out again
            while sched.wants_more():
                try:
                    idx = next(self._sampler_iter)
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
        try:
            fetcher = self._loader._fetchers[address]
            meta = pickle.dumps((fetcher.ref_id, (self._indices[seq], self._seed), None), protocol=5)
            this = weakref.ref(self)

            def on_result(ok, value, _seq=seq, _address=address):
                it = this()
                if it is not None:
                    it._on_result(_address, _seq, ok, value)

            rid = fetcher._conn.request(wire.CALL_REF, meta, callback=on_result, pin=self._pin)
        except (WorkerLost, OSError, KeyError) as exc:
            self._lose_worker(address, exc)
            return
        self._requests.setdefault(seq, {})[address] = rid

    def _lose_worker(self, address: str, exc: BaseException) -> None:
        state = self._sched.workers.get(address)
        if state is None or state.status == "lost":
            return  # every pending request of a dead connection reports it: act once
        requeued, blamed = self._sched.worker_lost(address)
        self._errors[address] = repr(exc)
        self._dataset.worker_lost(address, exc)
        for seq in requeued:
            self._requests.get(seq, {}).pop(address, None)
        warnings.warn(f"torchfeed: lost worker {address} ({exc}); its {len(requeued)} batch(es) go to "
                      "the other workers", stacklevel=2)
        if blamed is not None and self._sched.losses.get(blamed, 0) > self._loader.max_retries:
            indices = _as_list(self._indices.get(blamed))
            self._fatal = PoisonSampleError(
                f"loading samples {_short(indices)} (batch {blamed}) killed {self._sched.losses[blamed]} worker "
                f"processes in a row (the last: {address}); giving up after max_retries="
                f"{self._loader.max_retries}. Fix or exclude these samples.", indices, [address])
        if not self._sched.serving_workers() and self._stalled_since is None:
            self._stalled_since = time.monotonic()

    # -- membership changes (from the dataset) -----------------------------------------
    def _worker_joined(self, address: str) -> None:
        if self._closed:
            return
        failed = self._loader._ensure_fetchers([address])
        if failed:
            return
        with self._cond:
            if self._closed:
                return
            self._sched.add_worker(address)
            self._stalled_since = None
            self._dispatch()
            self._cond.notify_all()

    def _worker_removed(self, address: str) -> None:
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
                        value = value.with_indices(_as_list(self._indices.get(seq)))
                requests = self._requests.pop(seq, {}) if accepted else {}
                if accepted:
                    self._results[seq] = (ok, value)
                self._cancel({a: requests[a] for a in others if a in requests})
            self._hedge()  # a freed credit goes to an overdue batch before new work
            self._dispatch()
            self._cond.notify_all()

    def _cancel(self, requests: Dict[str, int]) -> None:
        for address, rid in requests.items():
            fetcher = self._loader._fetchers.get(address)
            if fetcher is not None:
                fetcher._conn.cancel([rid])

    # -- consumer ------------------------------------------------------------------
    def __next__(self):
        deadline = time.monotonic() + self._timeout if self._timeout else None
        with self._cond:
            while True:
                if self._closed:
                    raise StopIteration
                sched = self._sched
                seq = sched.delivered
                if seq in self._results:
                    ok, value = self._results.pop(seq)
                    self._progress.batches += 1
                    self._progress.samples += len(_as_list(self._indices.pop(seq, None)))
                    sched.take_delivered()
                    self._dispatch()
                    break
                if self._fatal is not None:
                    self._close_locked()
                    raise self._fatal
                if sched.finished():
                    self._progress.finished = True
                    self._close_locked()
                    raise StopIteration
                now = time.monotonic()
                stalled = self._stalled_since is not None
                if stalled and (now - self._stalled_since > (self._timeout or 120.0)
                                or (deadline is not None and now >= deadline)):
                    self._close_locked()
                    raise WorkerLost(f"no worker is left (waited {now - self._stalled_since:.1f} s for one "
                                     "to come back or join): "
                                     + "; ".join(f"{w}: {e}" for w, e in self._errors.items()), self._errors)
                if deadline is not None and now >= deadline:
                    holders = ", ".join(sched.holders(seq)) or "no worker (not dispatched yet)"
                    raise Timeout(f"batch {seq} (indices {_short(self._indices.get(seq))}) did not arrive "
                                  f"within timeout={self._timeout:g} s; it is held by {holders}")
                self._hedge()
                wait = _POLL if deadline is None else min(_POLL, deadline - now)
                self._cond.wait(wait)
        if not ok:
            raise value
        return value

    # -- shutdown ------------------------------------------------------------------
    def _close_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        by_worker: Dict[str, list] = {}
        for requests in self._requests.values():
            for address, rid in requests.items():
                by_worker.setdefault(address, []).append(rid)
        self._requests.clear()
        self._results.clear()
        for address, rids in by_worker.items():
            fetcher = self._loader._fetchers.get(address)
            if fetcher is not None:
                fetcher._conn.cancel(rids)

    def close(self) -> None:
        """Stop this pass: outstanding requests are cancelled."""
        with self._cond:
            self._close_locked()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _as_list(index) -> List[int]:
    if index is None:
        return []
    if isinstance(index, int):
        return [index]
    try:
        return [int(i) for i in index]
    except TypeError:
        return [index]


def _short(index) -> str:
    items = _as_list(index)
    return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:8]))}, ...]"
