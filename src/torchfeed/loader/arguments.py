"""RemoteDataLoader's arguments made into what it uses: its samplers, its multiprocessing
context (checked as torch's DataLoader checks them, with torch's messages) and its dataset."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler, SequentialSampler

from ..client import building
from .dataset import RemoteDataset
from .views import Source


class EndlessSampler(Sampler):
    """The sampler of an iterable-style dataset: keys do not matter (torch uses the same)."""

    def __iter__(self):
        while True:
            yield None


@dataclass
class Samplers:
    """A loader's sampling, as torch's DataLoader makes it from its arguments."""

    batch_size: int | None
    drop_last: bool
    sampler: Any
    batch_sampler: Any
    shuffle_generator: torch.Generator | None  # the loader's own, reseeded from (seed, epoch)
    own: bool  # made here (no sampler given): under torch.distributed every rank loads everything


def samplers(
    dataset, iterable: bool, batch_size, shuffle, sampler, batch_sampler, drop_last, seed, generator
):
    """The :class:`Samplers` of a loader with these arguments (torch's errors for conflicts)."""
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
            )
        batch_size = None
        drop_last = False
    elif batch_size is None and drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
        )
    shuffle_generator = None
    own = sampler is None and batch_sampler is None
    if sampler is None:
        if iterable:
            sampler = EndlessSampler()
        elif shuffle:
            if seed is not None:  # reseeded from (seed, epoch) at the start of every pass
                shuffle_generator = torch.Generator()
            sampler = RandomSampler(dataset, generator=shuffle_generator or generator)
        else:
            sampler = SequentialSampler(dataset)
    if batch_size is not None and batch_sampler is None:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    return Samplers(batch_size, drop_last, sampler, batch_sampler, shuffle_generator, own)


def multiprocessing_context(context, num_workers: int | None):
    """``context`` checked and made a context object, as torch's DataLoader does (workers do not
    use it)."""
    if context is None:
        return None
    if num_workers == 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers={num_workers}"
        )
    if isinstance(context, str):
        methods = multiprocessing.get_all_start_methods()
        if context not in methods:
            raise ValueError(
                "multiprocessing_context option should specify a valid start method in "
                f"{methods!r}, but got multiprocessing_context={context!r}"
            )
        context = multiprocessing.get_context(context)
    if not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context}"
        )
    return context


def remote_dataset(dataset, workers, args, kwargs):
    """The dataset to load from; builds one with ``workers=``; says what to do with a local dataset."""
    if workers is not None:
        if isinstance(dataset, RemoteDataset):
            raise TypeError("workers= builds a RemoteDataset from a dataset class; this one is already built")
        building.check_factory(dataset, "RemoteDataLoader(workers=...)")
        factory, kwargs = building.bind_own_keywords(dataset, kwargs or {})  # kwargs= are all the factory's
        return RemoteDataset(workers, factory, *args, **kwargs)
    try:
        Source(dataset)
    except TypeError:
        name = type(dataset).__qualname__
        shown = dataset.__qualname__ if isinstance(dataset, type) else name
        raise TypeError(
            f"RemoteDataLoader loads from remote workers and needs a RemoteDataset (or a Subset/ConcatDataset of "
            f"them), got {'the class ' + shown if isinstance(dataset, type) else 'a ' + name}. Build the dataset "
            f"on the workers: RemoteDataLoader(RemoteDataset(workers, {shown}, *args), ...), or "
            f"RemoteDataLoader(workers=[...], dataset={shown}, args=(...), ...)"
        ) from None
    return dataset
