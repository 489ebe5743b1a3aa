"""Shards: an IterableDataset made of shard files, handed to streams on demand.

With :class:`~torchfeed.RemoteDataLoader` the trainer keeps the epoch's queue of shards
and gives the next one to whichever stream has started all of its own (see
:mod:`torchfeed.loader.iterable`): a slow worker takes fewer shards. Every shard is read
exactly once per epoch, also when a worker is lost (the stream moves with the shards it
holds and its position in the current one). Anywhere else (torch's DataLoader, plain
iteration) shards are split statically: stream ``i`` of ``K`` reads every K-th shard of
the epoch's order.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from ..worker.streams import Inbox, NeedShard, shard_order


def _expand(urls: str | Sequence[str], storage_options: dict | None) -> list[str]:
    if not isinstance(urls, str):
        return list(urls)
    if not any(ch in urls for ch in "*?["):
        return [urls]
    import fsspec

    fs, _, paths = fsspec.get_fs_token_paths(urls, storage_options=storage_options or {})
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    found = sorted(paths)
    if not found:
        raise FileNotFoundError(f"no shard matches {urls!r}")
    return [p if protocol in ("file", "local") else f"{protocol}://{p}" for p in found]


class Shards(IterableDataset):
    """An iterable dataset of shard files (any fsspec URL), shards handed out on demand.

    Parameters
    ----------
    urls : str or sequence of str
        The shards; a string with ``*``, ``?`` or ``[`` is expanded with fsspec (sorted).
    open_shard : callable
        ``open_shard(url)`` returns an iterable of the shard's samples (a
        ``webdataset`` pipeline, the lines of a file, ...).
    shuffle : bool
        Shuffle the order of the shards every epoch, from ``(seed, epoch)``.
    seed : int, optional
        Seed of the shard order and of the shuffle buffers; by default the loader's base
        seed of the pass (so with the loader's ``seed=`` runs are reproducible).
    shuffle_buffer : int
        Shuffle samples within a shard through a buffer of this many samples (0: none),
        seeded per (seed, epoch, shard).
    storage_options : dict, optional
        For expanding a pattern with fsspec.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        open_shard: Callable[[str], Iterable],
        *,
        shuffle: bool = False,
        seed: int | None = None,
        shuffle_buffer: int = 0,
        storage_options: dict | None = None,
    ):
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {shuffle_buffer}")
        self.urls = _expand(urls, storage_options)
        if not self.urls:
            raise ValueError("Shards needs at least one shard")
        self.open_shard = open_shard
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch (for the shard order) when iterated outside RemoteDataLoader."""
        self.epoch = int(epoch)

    def __iter__(self) -> ShardReader:
        """Outside RemoteDataLoader: stream i of K reads every K-th shard of the epoch's order."""
        info = get_worker_info()
        wid, count = (info.id, info.num_workers) if info is not None else (0, 1)
        order = shard_order(len(self.urls), self.shuffle, 0 if self.seed is None else self.seed, self.epoch)
        return ShardReader(self, Inbox(order[wid::count], final=True))

    # -- torchfeed's hooks (see torchfeed.worker.streams and torchfeed.loader.iterable) -------------
    def _torchfeed_plan(self) -> tuple:
        return len(self.urls), self.shuffle, self.seed

    def _torchfeed_dynamic_iter(self, inbox: Inbox) -> ShardReader:
        return ShardReader(self, inbox)


class ShardReader:
    """The samples of the shards granted to one stream; Stateful (where it stands).

    Its state is the shards it was given, how many it finished and how many samples of
    the current one it yielded: loaded elsewhere, it opens that shard again and skips
    those samples (the shuffle buffer is seeded per shard, so the order is the same).
    """

    def __init__(self, shards: Shards, inbox: Inbox):
        self._shards = shards
        self._inbox = inbox
        self._granted: list[tuple] = []
        self._done = 0
        self._emitted = 0
        self._current: Any | None = None

    def __iter__(self) -> ShardReader:
        return self

    def __next__(self) -> Any:
        while True:
            if self._current is None:
                if self._done >= len(self._granted):
                    shard = self._inbox.take()
                    if shard is None:
                        if self._inbox.final:
                            raise StopIteration
                        raise NeedShard()
                    self._granted.append(tuple(shard))
                index, buffer_seed = self._granted[self._done]
                self._current = self._open(index, buffer_seed, skip=self._emitted)
            try:
                sample = next(self._current)
            except StopIteration:
                self._current = None
                self._done += 1
                self._emitted = 0
                continue
            self._emitted += 1
            return sample

    def _open(self, index: int, buffer_seed: int, skip: int):
        samples = iter(self._shards.open_shard(self._shards.urls[index]))
        if self._shards.shuffle_buffer > 1:
            samples = _buffered(samples, self._shards.shuffle_buffer, random.Random(buffer_seed))
        return itertools.islice(samples, skip, None)

    def state_dict(self) -> dict:
        return {"granted": [list(g) for g in self._granted], "done": self._done, "emitted": self._emitted}

    def load_state_dict(self, state: dict) -> None:
        self._granted = [tuple(g) for g in state["granted"]]
        self._done = state["done"]
        self._emitted = state["emitted"]
        self._current = None


def _buffered(samples, size: int, rng: random.Random):
    """A shuffle buffer: fill ``size`` samples, then yield a random one per sample read."""
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        k = rng.randrange(size)
        buffer[k], sample = sample, buffer[k]
        yield sample
    rng.shuffle(buffer)
    yield from buffer


def lines(url: str, storage_options: dict | None = None) -> Iterable[str]:
    """The lines of a text file at any fsspec URL (without line ends): an ``open_shard`` for text shards."""
    import fsspec

    with fsspec.open(url, "rt", **(storage_options or {})) as f:
        for line in f:
            yield line.rstrip("\n")
