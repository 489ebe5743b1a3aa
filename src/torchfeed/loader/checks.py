"""torch's DataLoader argument checks, with torch's messages, for RemoteDataLoader, then
its own (:func:`remote_args`).

Conflicting arguments raise what torch's DataLoader raises, in torch's order, so code
written against torch behaves the same (tests/test_loader_args.py compares them).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("torchfeed.loader")

_logged_once: set = set()
_logged_lock = threading.Lock()


def log_once(key: str, message: str) -> None:
    """Log ``message`` (a warning) the first time ``key`` is seen in this process."""
    with _logged_lock:
        if key in _logged_once:
            return
        _logged_once.add(key)
    log.warning(message)


def workers_args(num_workers, timeout, prefetch_factor, persistent_workers) -> None:
    """torch's checks, in torch's order; an omitted num_workers means: the remote workers."""
    if callable(num_workers):
        raise TypeError(
            "the 6th positional argument of RemoteDataLoader is num_workers, as in torch's "
            "DataLoader: pass collate_fn=... by keyword"
        )
    if num_workers is not None and num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing."
        )
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    if prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")


def iterable_args(shuffle, sampler, batch_sampler, audit: bool = False) -> None:
    if shuffle not in {False, None}:
        raise ValueError(
            f"DataLoader with IterableDataset: expected unspecified shuffle option, but got shuffle={shuffle}"
        )
    if sampler is not None:
        raise ValueError(
            f"DataLoader with IterableDataset: expected unspecified sampler option, but got sampler={sampler}"
        )
    if batch_sampler is not None:
        raise ValueError(
            "DataLoader with IterableDataset: expected unspecified batch_sampler option, but got "
            f"batch_sampler={batch_sampler}"
        )
    if audit:
        raise ValueError(
            "audit=True records the sample keys an epoch delivered: an iterable-style "
            "dataset has none (audit a map-style dataset)"
        )


def remote_args(seed, generator, prefetch_factor) -> None:
    """RemoteDataLoader's own rules, checked after torch's."""
    if seed is not None and generator is not None:
        raise ValueError(
            "give seed= or generator=, not both: with seed the shuffle order and every "
            "sample's random draws come from (seed, epoch)"
        )
    if prefetch_factor == 0:
        raise ValueError(
            "prefetch_factor must be at least 1 with remote workers (it is the number "
            "of requests each worker holds)"
        )


def log_ignored(workers: int, iterable: bool, num_workers, context, pin_memory_device, in_order) -> None:
    """Say once per process which of torch's arguments have no effect here, and why."""
    if num_workers and not iterable:  # iterable-style: the number of streams
        log_once(
            "num_workers",
            f"RemoteDataLoader: num_workers={num_workers} has no effect: loading runs on "
            f"the RemoteDataset's {workers} worker process(es); for more, start more `torchfeed worker` "
            "processes (--procs) and list them all",
        )
    if context is not None:
        log_once(
            "multiprocessing_context",
            "RemoteDataLoader: multiprocessing_context has no effect: the "
            "workers are processes started by `torchfeed worker`, not by this loader",
        )
    if pin_memory_device:
        log_once(
            "pin_memory_device",
            "RemoteDataLoader: pin_memory_device has no effect: with "
            "pin_memory=True batches are received into memory pinned for CUDA",
        )
    if not in_order:
        log_once(
            "in_order",
            "RemoteDataLoader: in_order=False has no effect: batches always come in "
            "sampler order (slow workers are given later batches instead, so order costs little)",
        )


def job_ranks() -> tuple[int, int]:
    """(rank, ranks) of this job: torch.distributed's once initialized, else torchrun's RANK and
    WORLD_SIZE, else (0, 1). The one place the job's ranks are read (the loader's checks and
    :class:`~torchfeed.DistributedSampler` alike); ValueError names a RANK or WORLD_SIZE that is
    not a rank of the job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    given = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE")}
    try:
        rank, world = int(given["RANK"] or "0"), int(given["WORLD_SIZE"] or "1")
    except ValueError:
        rank = world = -1
    if not 0 <= rank < world:
        raise ValueError(
            f"the environment names no rank of this job: RANK={given['RANK']!r}, WORLD_SIZE="
            f"{given['WORLD_SIZE']!r}; RANK must be an integer in [0, WORLD_SIZE) (torchrun sets both): "
            "fix or unset them, or pass num_replicas= and rank= to the sampler"
        )
    return rank, world


def stream_ranks(rank_streams: bool | None, streams: int) -> tuple[int, int]:
    """(rank, ranks) to number an iterable-style pass's streams across: the job's with
    ``rank_streams=True``, else (0, 1): every rank reads every stream, as torch's DataLoader
    does, said once when ``rank_streams`` was left to None in a job of several ranks."""
    rank, world = job_ranks()
    if world <= 1 or rank_streams is False:
        return 0, 1
    if rank_streams:
        return rank, world
    log_once(
        "rank-streams",
        f"iterable-style loader in a job of {world} ranks: every rank reads all {streams} streams (as torch's "
        "DataLoader does), and the dataset on the workers cannot ask torch.distributed for this rank. "
        "If it splits its data by get_worker_info() alone, pass rank_streams=True: the streams are then "
        f"numbered across the ranks (rank r reads streams r*{streams}..r*{streams}+{streams - 1} of "
        f"{world * streams}) and Shards hands each rank its share; rank_streams=False silences this",
    )
    return 0, 1


def warn_unsharded(own_sampling: bool, iterable: bool) -> None:
    """Say once, at WARNING, that every rank loads the whole dataset: a loader that made its own
    sampler (none given) in a job of several ranks, as torch's DataLoader does under torchrun."""
    if not own_sampling or iterable:
        return
    world = job_ranks()[1]
    if world <= 1:
        return
    log_once(
        "unsharded",
        f"this job has {world} ranks and RemoteDataLoader was given no sampler: every rank "
        "loads the whole dataset (as torch's DataLoader does). To give each rank its share, pass "
        "sampler=torch.utils.data.DistributedSampler(dataset) or torchfeed.DistributedSampler(dataset) "
        "(and call loader.set_epoch(epoch) every epoch), or let a framework shard it (Lightning and "
        "Fabric do; Accelerate through torchfeed.frameworks.accelerate.prepare).",
    )
