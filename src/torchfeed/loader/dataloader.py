"""RemoteDataLoader: torch's DataLoader, with remote workers.

It takes DataLoader's arguments in DataLoader's order, checks them as DataLoader does
(same errors), and yields the same batches for the same sampler order. A pass over a
map-style dataset is :class:`torchfeed.loader.passes.MapPass`; over an iterable-style one,
:class:`torchfeed.loader.iterable.IterablePass`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data._utils.collate import default_collate, default_convert

from .. import stats
from ..protocol import buffers, codec, limits
from . import arguments, cache, checks, prefetch, resume
from .dataset import RemoteDataset
from .iterable import IterablePass
from .passes import MapPass
from .passstats import PassStats, Probe
from .pending import PendingPass
from .plan import BatchRequests, LoaderConfig, LoaderFetchers, PassPlan, new_pass_id
from .position import Position
from .sampling import mix_seed
from .views import Source

log = logging.getLogger("torchfeed.loader")

T_co = TypeVar("T_co", covariant=True)


# Assigning these after construction raises, as in torch.
_FROZEN = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


class RemoteDataLoader(DataLoader[T_co]):
    """Drop-in replacement for ``torch.utils.data.DataLoader`` with remote workers.

    Takes DataLoader's arguments (same order, same meanings, same errors for conflicting
    ones) and yields the same batches for the same sampler order. Loading and collation
    run on the workers of the :class:`RemoteDataset`.

    It is a ``DataLoader`` subclass (torch's ``__init__`` is not run: nothing of torch's
    local loading is used), so training frameworks treat it as one: Lightning and Fabric
    re-create it with their ``DistributedSampler`` from its public attributes, which hold
    every constructor argument. A pass starts at the first ``next()``: ``iter()`` alone
    loads nothing and leaves the epoch as it is (see :mod:`torchfeed.loader.pending`).
    Accelerate and the HF Trainer need one line each (:mod:`torchfeed.frameworks`).

    Parameters
    ----------
    dataset : RemoteDataset, or a Subset / random_split part / ConcatDataset of RemoteDatasets
        What to load (keys are mapped in the trainer). With ``workers=``, a dataset class or
        factory to build there instead.
    batch_size, shuffle, sampler, batch_sampler, collate_fn, drop_last, generator
        As in torch's DataLoader. Keys are whatever the sampler yields (ints, strings, tuples).
    num_workers, multiprocessing_context, pin_memory_device, in_order
        Checked as torch checks them, then without effect (logged once): the remote workers
        do the loading, and batches always come in sampler order.
        For an iterable-style dataset ``num_workers`` is the number of streams (default:
        the number of workers), as torch's worker processes; see :mod:`torchfeed.loader.iterable`.
    pin_memory : bool
        Receive batches directly into pinned memory (when CUDA is available).
    timeout : float
        Seconds to wait for the next batch before raising :class:`Timeout` (a RuntimeError);
        0 waits without limit (dead workers are still detected by heartbeats). Also how long
        a pass waits for a worker when none is left (120 s when 0).
    worker_init_fn : callable, optional
        Called as ``worker_init_fn(worker_id)`` on every worker at the start of each pass
        (once per worker with ``persistent_workers=True``), after the worker's generators
        are seeded as torch seeds its workers; ``get_worker_info().dataset`` is then that
        loader's own copy of the worker's dataset, which it may configure.
    prefetch_factor : int, optional
        Requests in flight per worker (default 2).
    persistent_workers : bool
        Run ``worker_init_fn`` once per worker instead of every pass (as in torch).
    seed : int, optional
        Makes loading exactly reproducible: the shuffle order comes from (seed, epoch), and
        with per-sample seeding every sample's draws from (seed, epoch, key). Without it the
        base seed is drawn from ``generator`` (or torch's global generator) each pass, as
        torch's DataLoader does. With it (and per-sample seeding), when the next pass's
        order is known in advance (a sequential sampler, ``shuffle=True``, or torch's
        ``DistributedSampler`` advanced by ``set_epoch``), the next pass's first batches
        are loaded while this one drains; they are used only if that pass asks for the
        same keys (results are identical either way).
    per_sample_seeding : bool
        True (default): every sample's ``__getitem__`` runs with Python's, numpy's and torch's
        global generators seeded from (base seed, key), so results do not depend on which
        worker loads a sample (seeding done in ``worker_init_fn`` does not reach samples).
        False: torch's behaviour: each worker's generators are seeded with base seed + worker
        id at the start of a pass, then ``worker_init_fn`` runs, and samples draw from there.
    workers, args, kwargs
        The seed's other form: ``RemoteDataLoader(workers=[...], dataset=Cls, kwargs={...})``
        builds the :class:`RemoteDataset` itself.
    max_retries : int
        A batch whose loading killed a worker process is retried on at most this many
        other workers, then :class:`PoisonSampleError` names its samples.
    straggler_factor : float or None
        A batch needed soon that runs longer than this many times the typical batch time
        (and at least ``straggler_min_seconds``) is duplicated on a worker with a free
        credit; the first result wins. ``None`` disables duplication.
    safe_globals : list, optional
        Classes (or functions) that batches may contain beyond what torchfeed loads by
        default (builtin containers and scalars, tensors, numpy arrays and scalars) and
        what :func:`torchfeed.add_safe_globals` and the dataset's session allow: a worker's
        reply runs no code in the trainer (:class:`~torchfeed.errors.UnsafeReplyError`
        names what was refused). E.g. ``safe_globals=[MyRecord, PIL.Image.Image]``.
    compression : {"session", "auto", "lz4", "zstd", None}
        How batches' tensor and array buffers travel: ``"auto"`` compresses a buffer (lz4 or
        zstd, per buffer, decided from a sample of its data and the measured link and
        compression speeds) when that delivers it sooner; ``"lz4"``/``"zstd"`` always try that
        codec; None never compresses. Default: the dataset's session's (``"auto"``).
    rank_streams : bool, optional
        Iterable-style datasets in a job of several ranks (``torch.distributed`` initialised,
        or torchrun's ``WORLD_SIZE``). True: number the K streams of every rank across the job,
        so rank r's streams see ``get_worker_info()`` ids ``r*K ... r*K+K-1`` of ``W*K`` and a
        dataset that splits its data by worker id gives each rank its own share (the worker
        cannot ask ``torch.distributed`` for the trainer's rank); ``Shards`` hands each rank its
        share of the shards. False: every rank reads every stream, as torch's DataLoader does.
        None (default): as False, said once at WARNING in such a job.
    audit : bool
        Record the integer sample keys each epoch delivers in the loader's state
        (``state_dict()["audit"]``), so :func:`torchfeed.audit.verify` can prove from a job's
        saved states that an epoch delivered every sample exactly once across its ranks and
        resumes (:mod:`torchfeed.loader.audit`). Map-style datasets only.
    """

    def __init__(
        self: RemoteDataLoader[Any],  # mypy cannot tell a remote dataset's item type: Any
        dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler[list] | Iterable[list] | None = None,
        num_workers: int | None = None,
        collate_fn: Callable | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 120,
        worker_init_fn: Callable | None = None,
        multiprocessing_context=None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        per_sample_seeding: bool = True,
        max_retries: int = 2,
        straggler_factor: float | None = 4.0,
        straggler_min_seconds: float = 0.05,
        workers: Sequence[str] | None = None,
        args: Sequence = (),
        kwargs: dict | None = None,
        safe_globals: Sequence[Any] | None = None,
        compression: str | None = "session",
        rank_streams: bool | None = None,
        audit: bool = False,
    ):
        checks.workers_args(num_workers, timeout, prefetch_factor, persistent_workers)
        dataset = arguments.remote_dataset(dataset, workers, args, kwargs)
        source = Source(dataset)
        if source.iterable:
            checks.iterable_args(shuffle, sampler, batch_sampler, audit)
        checks.remote_args(seed, generator, prefetch_factor)
        self._initialized = False
        self._source = source
        # a cached dataset: its hits, polled from the workers without blocking stats()
        cached = isinstance(dataset, RemoteDataset) and cache.is_cached(dataset.factory)
        self._cache_probe = Probe(dataset) if cached else None
        self.num_workers = len(source.workers) if num_workers is None else num_workers
        self._num_streams = num_workers  # iterable-style: the number of streams (None: one per worker)
        self.multiprocessing_context = multiprocessing_context  # checked by the property, as in torch
        checks.log_ignored(
            len(self._source.workers),
            self._source.iterable,
            # a loader re-created from its attributes (frameworks do) passes the worker count back
            None if num_workers == len(self._source.workers) else num_workers,
            multiprocessing_context,
            pin_memory_device,
            in_order,
        )
        made = arguments.samplers(
            dataset, source.iterable, batch_size, shuffle, sampler, batch_sampler, drop_last, seed, generator
        )
        batch_size, drop_last, sampler, batch_sampler = (
            made.batch_size,
            made.drop_last,
            made.sampler,
            made.batch_sampler,
        )
        self._shuffle_generator = made.shuffle_generator
        self._own_sampling = made.own
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.generator = generator
        # as torch: None with num_workers=0 (re-creating the loader from its attributes must pass
        # torch's checks); requests in flight per worker are then 2
        self.prefetch_factor = 2 if prefetch_factor is None and self.num_workers != 0 else prefetch_factor
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.in_order = in_order
        self.persistent_workers = persistent_workers
        self.seed = seed
        self.per_sample_seeding = per_sample_seeding
        self.audit = audit
        self.max_retries = max_retries
        self.straggler_factor = straggler_factor
        self.straggler_min_seconds = straggler_min_seconds
        self.safe_globals = safe_globals  # as given (frameworks re-create the loader from attributes)
        self.compression = compression
        self.rank_streams = rank_streams
        self._reply_policy = source.session.reply_policy.with_globals(safe_globals)
        self._compression = (
            source.session.compression if compression == "session" else codec.check_mode(compression)
        )
        if collate_fn is None:
            collate_fn = default_collate if self._auto_collation else default_convert
        self.collate_fn = collate_fn
        self._fetchers = LoaderFetchers(source, self._auto_collation, persistent_workers)
        self._position = Position()  # epoch of the next pass, latest pass and iterator, a loaded state
        # read by code written for torch's DataLoader (Lightning resets it): no torch iterator here
        self._iterator = None
        self._estimates: dict = {}  # seconds per batch of each worker, from the latest pass
        self._head: prefetch.Head | None = None  # the next pass's first batches, prefetched
        self._prefetch = True  # load the next pass's first batches ahead when it is predictable
        self._accounting = stats.Accounting()  # what stats() reads; every pass reports into it
        self._initialized = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FROZEN and self.__dict__.get("_initialized"):
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is initialized")
        super().__setattr__(name, value)

    @property
    def multiprocessing_context(self):
        """Checked and stored as torch's DataLoader does; workers do not use it."""
        return self._multiprocessing_context

    @multiprocessing_context.setter
    def multiprocessing_context(self, context) -> None:
        self._multiprocessing_context = arguments.multiprocessing_context(context, self.num_workers)

    def check_worker_number_rationality(self) -> None:
        """torch warns here about too many local worker processes; remote workers need no check."""

    # -- epochs, state and resume -------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Epoch of the next pass (it then advances by one per pass), like DistributedSampler.

        Also sets the epoch of the sampler, the batch sampler and the batch sampler's sampler
        where they have ``set_epoch`` (as Accelerate's loaders do), so a ``DistributedSampler``
        reshuffles when a training loop calls only ``loader.set_epoch(e)``.
        """
        self._position.epoch = int(epoch)
        seen: set[int] = set()
        parts: tuple[Any, ...] = (
            self.sampler,
            self.batch_sampler,
            getattr(self.batch_sampler, "sampler", None),
        )
        for part in parts:
            if part is not None and id(part) not in seen and callable(getattr(part, "set_epoch", None)):
                seen.add(id(part))
                part.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """Epoch of the next pass."""
        return self._position.epoch

    def state_dict(self, *, leave_out: int | None = None) -> dict:
        """Where loading stands: small plain data to store in a checkpoint.

        Loaded into a new loader (same dataset, sampler settings and seed; any workers),
        the next pass yields exactly the batches this pass had not yet yielded. A batch counts
        as yielded once the consumer asks for the next one, or when the state is taken on the
        consumer's normal path; a state taken while an exception unwinds (a checkpoint on
        Ctrl-C or on an error, in an ``except`` or ``finally``) leaves out the batch the consumer
        had not come back from, which may not have been trained on: a resume loads it again.
        A state loaded and not yet resumed is given back as it was loaded.

        ``leave_out``: how many of the last batches handed out count as not used: 1 for a save
        in a signal handler (it may run inside a step), more for a wrapper that reads ahead of
        its own consumer (at most 2 for a map-style pass, 1 for an iterable-style one);
        default as above.
        """
        return self._position.state(self.seed, leave_out, self._full_batch)

    def _full_batch(self) -> int | None:
        full = self.batch_size if self._auto_collation else 1
        if full is None:  # a batch sampler of the user's
            full = getattr(self.batch_sampler, "batch_size", None)
        return full

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next pass continues where that one stopped."""
        self._position.load(state, self.seed)

    @property
    def _auto_collation(self) -> bool:
        return self.batch_sampler is not None

    @property
    def _index_sampler(self):
        return self.batch_sampler if self._auto_collation else self.sampler

    def __len__(self) -> int:
        if self._source.iterable:  # as torch: from the dataset's length, if it has one
            length = len(self.dataset)  # type: ignore[arg-type]  # an iterable RemoteDataset's length
            if self.batch_size is not None:
                length = length // self.batch_size if self.drop_last else -(-length // self.batch_size)
            return length
        return len(self._index_sampler)

    def __iter__(self) -> PendingPass:  # type: ignore[override]
        """A pass that starts at its first ``next()`` (:class:`~torchfeed.loader.pending.PendingPass`)."""
        buffers.check_pinnable(self.pin_memory)
        # drawn here, where torch's iterator draws it (Position.base_seed)
        base_seed = self._position.base_seed(self.seed, self.generator, self.persistent_workers)
        pending = PendingPass(lambda: self._start_pass(base_seed), self.__len__)
        self._position.made(pending)
        return pending

    def _start_pass(self, base_seed: int | resume.Drawn | None) -> MapPass | IterablePass:
        """Begin the pass (at the first ``next()`` of the iterator ``__iter__`` returned)."""
        resume_from = self._position.take_resume()
        checks.warn_unsharded(self._own_sampling, self._source.iterable)
        fetchers = self._fetchers.for_pass(self.collate_fn, self.worker_init_fn)
        sampler_iter, progress = resume.begin_pass(
            self._sampling(),
            self._position.epoch,
            resume_from,
            base_seed,
            index_sampler=self._index_sampler,
            shuffle_generator=self._shuffle_generator,
        )
        self._position.began(progress, self.seed)
        base_seed = progress.record.base_seed
        plan = PassPlan(
            config=self._config(),
            source=self._source,
            fetchers=fetchers,
            sampler_iter=sampler_iter,
            progress=progress,
            auto_collation=self._auto_collation,
            base_seed=base_seed,
            sample_seed=base_seed if self.per_sample_seeding else None,
            estimates=self._estimates,
            on_estimates=self._keep_estimates,
            on_snapshot=self._position.iterable_closed,
            next_head=self._prefetch_next,
            stats=PassStats(self._accounting, self._cache_probe),
        )
        if self._source.iterable:
            streams = resume_from.get("streams") if resume_from is not None else None
            count = self._stream_count()
            ranks = checks.stream_ranks(self.rank_streams, count)
            running = IterablePass(plan, streams, stream_count=count, ranks=ranks)
            self._position.iterable_started(running)
            return running
        head, self._head = self._head, None
        return MapPass(plan, head)

    def _sampling(self) -> resume.Sampling:
        return resume.Sampling(
            seed=self.seed,
            generator=self.generator,
            sampler=self.sampler,
            batch_sampler=self.batch_sampler,
            per_sample_seeding=self.per_sample_seeding,
            audit=self.audit,
        )

    def _config(self) -> LoaderConfig:
        try:
            length: int | None = len(self)
        except TypeError:
            length = None
        return LoaderConfig(
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            pin_memory=self.pin_memory,
            timeout=self.timeout,
            prefetch_factor=self.prefetch_factor or 2,
            max_retries=self.max_retries,
            straggler_factor=self.straggler_factor,
            straggler_min_seconds=self.straggler_min_seconds,
            length=length,
            reply_policy=self._reply_policy,
            compression=self._compression,
            # the first batch is split only where nothing depends on a reply's size: lowered
            # reply limits bound the batch, not its parts (loader/split.py)
            split_first=self._auto_collation and self.collate_fn is default_collate and not limits.lowered(),
        )

    def _keep_estimates(self, estimates: dict[str, float]) -> None:
        """A map-style pass closed: its per-worker batch times seed the next pass's scheduler."""
        self._estimates = estimates

    # -- statistics -------------------------------------------------
    def stats(self) -> stats.LoaderStats:
        """Is the trainer waiting for data? A :class:`torchfeed.LoaderStats` snapshot, cheap
        enough to call every step: the share of time ``__next__`` waited (this pass and the
        last 30 s), rates, per-worker statistics and one sentence of advice."""
        figures = self._cache_probe.figures() if self._cache_probe is not None else None
        return self._accounting.snapshot(self._source.workers, cache=figures)

    def log_stats(self, every: float | None = 30.0) -> None:
        """Log a one-line summary at INFO (logger ``torchfeed.stats``) every ``every`` seconds
        while batches are taken; ``None`` stops it."""
        if every is not None and every <= 0:
            raise ValueError(f"every must be a positive number of seconds or None, got {every}")
        self._accounting.log_every(every)

    def _prefetch_next(self, ending: MapPass):
        """Called by a pass whose last batch is dispatched (``PassPlan.next_head``): start loading
        the next pass's first batches if they can be known now (:mod:`torchfeed.loader.prefetch`); the
        head, or None."""
        old, self._head = self._head, None
        if old is not None:
            old.discard()
        if not self._prefetch:
            return None
        epoch = self._position.epoch
        count = ending.prefetch_count()
        indices = prefetch.predict(self._sampling(), epoch, count, self._shuffle_generator)
        if not indices or self.seed is None:  # predict() gives none without a seed
            return None
        base_seed = mix_seed(self.seed, epoch)
        requests = BatchRequests(
            fetchers=self._fetchers.for_pass(self.collate_fn, self.worker_init_fn),
            source=self._source,
            auto=self._auto_collation,
            pin=self.pin_memory,
            policy=self._reply_policy,
            compression=self._compression,
            pass_id=new_pass_id(),
            base_seed=base_seed,
            sample_seed=base_seed if self.per_sample_seeding else None,
        )
        head = prefetch.Head(requests, epoch=epoch, indices=indices, estimates=ending.estimates())
        self._head = head
        return head

    def _stream_count(self) -> int:
        """Iterable-style: K streams, as torch's K worker processes (one per worker by default)."""
        if self._num_streams is None:
            return max(len(self._source.workers), 1)
        return max(self._num_streams, 1)
