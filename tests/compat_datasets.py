"""Datasets for the side-by-side and compatibility tests (importable on the workers too)."""

from __future__ import annotations

import collections
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from helpers import SizedDataset

Pair = collections.namedtuple("Pair", "x y")


class CorruptSample(Exception):
    """A user-defined exception type with its own constructor."""

    def __init__(self, index, reason):
        super().__init__(f"sample {index}: {reason}")
        self.index = index
        self.reason = reason


class Typed(SizedDataset):
    """Samples of many types and dtypes; ``bad`` maps an index to the exception it raises."""

    def __init__(self, n: int = 23, bad=None):
        super().__init__(n)
        self.bad = dict(bad or {})

    def __getitem__(self, i):
        if i in self.bad:
            kind = self.bad[i]
            if kind == "key":
                raise KeyError(f"missing {i}")
            if kind == "index":
                raise IndexError(i)
            if kind == "file":
                raise FileNotFoundError(2, "No such file or directory", f"/data/{i}.jpg")
            if kind == "custom":
                raise CorruptSample(i, "truncated JPEG")
            raise ValueError(f"bad sample {i}")
        return {
            "f16": torch.full((2,), i, dtype=torch.float16),
            "bf16": torch.tensor([i / 3], dtype=torch.bfloat16),
            "bool": torch.tensor(i % 2 == 0),
            "c64": torch.tensor(complex(i, -i), dtype=torch.complex64),
            "i8": torch.tensor([i - 10], dtype=torch.int8),
            "u8": np.full((2, 2), i, dtype=np.uint8),
            "f64": np.float64(i) / 7,
            "int": i,
            "float": i * 0.5,
            "str": f"s{i}",
            "bytes": bytes([i % 256]) * 3,
            "pair": Pair(torch.tensor(i), [i, -i]),
            "nested": {"t": (torch.arange(3) * i, np.arange(2, dtype=np.int16) + i)},
        }


class Plain(SizedDataset):
    """Sample i is (float tensor of i, i)."""

    def __init__(self, n: int = 23):
        super().__init__(n)

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i


class Keyed(Dataset):
    """A dict-backed dataset: keys are strings and tuples, as a sampler yields them."""

    def __init__(self):
        self.items = {f"img{i:03d}": i for i in range(12)}
        self.items.update({("shard", i): 100 + i for i in range(4)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, key):
        return torch.tensor(self.items[key])


class Batched(Plain):
    """Has __getitems__ (one call per batch), which may fail."""

    def __init__(self, n: int = 23, fail_on=None):
        super().__init__(n)
        self.fail_on = fail_on

    def __getitems__(self, indices):
        if self.fail_on is not None and self.fail_on in indices:
            raise LookupError(f"batch with {self.fail_on}")
        return [self[i] for i in indices]


class StopsAt(Plain):
    """__getitem__ raises StopIteration at one index."""

    def __init__(self, at: int):
        super().__init__(8)
        self.at = at

    def __getitem__(self, i):
        if i == self.at:
            raise StopIteration
        return super().__getitem__(i)


class Failing(Plain):
    """Its constructor raises."""

    def __init__(self, n: int = 23):
        raise PermissionError(13, "Permission denied", "/data/train")


class Random(SizedDataset):
    """Draws from Python's, numpy's and torch's global generators; reports the seeds."""

    def __init__(self, n: int = 12):
        super().__init__(n)

    def __getitem__(self, i):
        return torch.tensor(
            [
                i,
                torch.initial_seed(),
                random.randint(0, 10**6),
                np.random.randint(10**6),
                int(torch.randint(10**6, ())),
            ]
        )


class Info(SizedDataset):
    """Sample i: (i, worker id, number of workers, worker seed, is info.dataset this instance,
    torch.initial_seed(), pid), and the dataset's tag. Sleeps ``delay`` seconds per sample."""

    def __init__(self, n: int = 16, delay: float = 0.0):
        super().__init__(n)
        self.delay = delay
        self.tag = "built"
        self.built_with_info = get_worker_info()  # None: construction is not loading

    def __getitem__(self, i):
        import os
        import time

        if self.delay:
            time.sleep(self.delay)
        info = get_worker_info()
        assert info is not None  # loaded by a worker
        return torch.tensor(
            [
                i,
                info.id,
                info.num_workers,
                info.seed,
                int(info.dataset is self),
                torch.initial_seed(),
                os.getpid(),
            ]
        ), self.tag


def tag_with_worker(worker_id: int) -> None:
    """A worker_init_fn that configures get_worker_info().dataset (and checks the seed it sees)."""
    info = get_worker_info()
    assert info is not None and info.id == worker_id and torch.initial_seed() == info.seed
    dataset: Any = info.dataset  # the worker's copy of the user's dataset
    dataset.tag = f"init{worker_id}"


def seed_numpy_like_torch_docs(worker_id: int) -> None:
    """torch's reproducibility recipe for numpy in workers."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


class Shards(IterableDataset):
    """An iterable dataset split among workers in __iter__ with get_worker_info()."""

    def __init__(self, n: int = 23, fail_at=None):
        self.n = n
        self.fail_at = fail_at

    def __iter__(self):
        info = get_worker_info()
        wid, count = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, count):
            if i == self.fail_at:
                raise RuntimeError(f"stream broke at {i}")
            yield torch.tensor([i, wid]), float(torch.rand(()))


class SlowShards(Shards):
    def __init__(self, n: int = 40, delay: float = 0.05):
        super().__init__(n)
        self.delay = delay

    def __iter__(self):
        import time

        for item in super().__iter__():
            time.sleep(self.delay)
            yield item


class Span(IterableDataset):
    """torch's documentation example: worker_init_fn splits [start, end) among workers."""

    def __init__(self, start: int, end: int):
        self.start = start
        self.end = end

    def __iter__(self):
        return iter(range(self.start, self.end))

    def __len__(self):
        return self.end - self.start


def split_span(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    dataset: Any = info.dataset  # the copy that loads
    overall_start, overall_end = dataset.start, dataset.end
    per_worker = -(-(overall_end - overall_start) // info.num_workers)
    dataset.start = overall_start + info.id * per_worker
    dataset.end = min(dataset.start + per_worker, overall_end)


def dict_collate(batch):
    return {"first": batch[0], "n": len(batch), "sum": sum(float(x[0].sum()) for x in batch)}


def failing_collate(batch):
    raise ArithmeticError(f"cannot collate {len(batch)} samples")
