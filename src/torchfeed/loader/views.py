"""Trainer side: what a loader loads from, and how its sampler's keys reach the workers.

A loader's dataset is a :class:`RemoteDataset`, or a view of RemoteDatasets made with
torch's own ``Subset``, ``random_split`` and ``ConcatDataset`` (also nested). A
:class:`Source` maps each key the sampler yields to the key of the remote instance, in
the trainer: ``Subset(ds, idx)[i]`` is ``ds[idx[i]]``, a ``ConcatDataset`` key becomes
(part, key in that part). Workers load every part, so a ``ConcatDataset`` of several
RemoteDatasets uses the workers all of them were built on.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.data import ConcatDataset, Subset

from ..worker.fetch import Parts
from .dataset import MembershipListener, RemoteDataset

Mapper = Callable[[Any], tuple[int, Any]]


def _plain(key: Any) -> Any:
    """Ints of any kind (numpy, 0-d tensors) as Python ints; other keys as they are."""
    try:
        return operator.index(key)
    except TypeError:
        return key


def _resolve(dataset: Any, parts: list[RemoteDataset]) -> Mapper:
    """Collect the RemoteDatasets under ``dataset`` into ``parts``; return key -> (part, key)."""
    if isinstance(dataset, RemoteDataset):
        seen = [i for i, part in enumerate(parts) if part is dataset]
        if seen:  # the same dataset twice (ConcatDataset([d, d])): one part
            number = seen[0]
        else:
            parts.append(dataset)
            number = len(parts) - 1

        def to_part(key: Any) -> tuple[int, Any]:
            return number, _plain(key)

        return to_part
    if isinstance(dataset, Subset):
        inner = _resolve(dataset.dataset, parts)
        indices = dataset.indices
        return lambda key: inner(indices[key])
    if isinstance(dataset, ConcatDataset):
        children = [_resolve(d, parts) for d in dataset.datasets]
        bounds = list(dataset.cumulative_sizes)

        def concat(key):
            key = operator.index(key)
            if key < 0:
                if -key > bounds[-1]:
                    raise ValueError("absolute value of index should not exceed dataset length")
                key += bounds[-1]
            child = bisect.bisect_right(bounds, key)
            return children[child](key - (bounds[child - 1] if child else 0))

        return concat
    raise TypeError(
        f"RemoteDataLoader cannot load from a {type(dataset).__qualname__}: give it a RemoteDataset, or a "
        "Subset, random_split part or ConcatDataset of RemoteDatasets. To load a local dataset remotely, "
        "build it on the workers: RemoteDataset(workers, DatasetClass, *args)"
    )


class Source:
    """The RemoteDatasets a loader loads from and the mapping of its keys (see the module doc)."""

    def __init__(self, dataset: Any):
        self.parts: list[RemoteDataset] = []
        mapper = _resolve(dataset, self.parts)
        self.direct = isinstance(dataset, RemoteDataset)
        self._mapper: Mapper | None = None if self.direct else mapper
        first = self.parts[0]
        if len(self.parts) > 1:
            if any(p.iterable for p in self.parts):
                raise ValueError("a ConcatDataset of iterable-style RemoteDatasets cannot be loaded")
            if not self.workers:
                raise ValueError(
                    "the RemoteDatasets of this ConcatDataset were built on different workers "
                    f"({[p.workers for p in self.parts]}): build them on the same workers"
                )
        self.iterable = first.iterable
        self.timeout = first.timeout
        self.secret = first.secret
        self.session = first.session

    # -- membership (the intersection of the parts') ----------------------------------
    @property
    def workers(self) -> list[str]:
        first, rest = self.parts[0], self.parts[1:]
        return [w for w in first.workers if all(w in p.workers for p in rest)]

    def alive_workers(self) -> list[str]:
        first, rest = self.parts[0], self.parts[1:]
        alive = first.alive_workers()
        for p in rest:
            theirs = set(p.alive_workers())
            alive = [w for w in alive if w in theirs]
        return alive

    def worker_id(self, address: str) -> tuple[int, int]:
        """(id, number of workers) as ``get_worker_info()`` reports them on ``address``."""
        workers = self.workers
        return (workers.index(address) if address in workers else len(workers)), max(len(workers), 1)

    def worker_lost(self, address: str, error: BaseException) -> None:
        for p in self.parts:
            p.worker_lost(address, error)

    def subscribe(self, listener: MembershipListener) -> None:
        for p in self.parts:
            p.subscribe(listener)

    def target(self, address: str) -> Any:
        """What the worker-side fetcher loads from: the instance, or all parts' instances."""
        if len(self.parts) == 1:
            return self.parts[0].ref(address)
        return Parts([p.ref(address) for p in self.parts])

    # -- keys ----------------------------------------------------------------------
    def map_key(self, key: Any) -> Any:
        if self._mapper is None:
            return key
        part, mapped = self._mapper(key)
        return mapped if len(self.parts) == 1 else (part, mapped)

    def map_index(self, index: Any, auto_collation: bool) -> Any:
        """The sampler's output (a batch of keys, or one key) as the workers' keys."""
        if self._mapper is None:
            return index
        if auto_collation:
            return [self.map_key(k) for k in index]
        return self.map_key(index)


def keys_of(index: Any, auto_collation: bool) -> list[Any]:
    """The sample keys of one sampler output (for messages and counting)."""
    if index is None:
        return []
    if auto_collation:
        return list(index) if isinstance(index, Sequence) or hasattr(index, "__iter__") else [index]
    return [index]
