"""A cached dataset's ``then`` cannot change what is kept (real worker processes)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import cache_datasets as cd
import torchfeed
from torchfeed import RemoteDataLoader, RemoteDataset
from torchfeed.datasets import Shards

pytestmark = pytest.mark.timeout(180)


def doubled_in_place(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(2)  # works in place on what it is given


def lines_in_place(x: torch.Tensor) -> torch.Tensor:
    return x.add_(100)


def _batches(ds, **kw):
    return list(RemoteDataLoader(ds, straggler_factor=None, **kw))


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_then_working_in_place_changes_neither_another_job_nor_its_next_epoch(fresh_workers):
    w = fresh_workers(2).addresses
    n = 24
    a = RemoteDataset(w, torchfeed.cached(cd.Decoded, then=doubled_in_place), n)  # job A
    b = RemoteDataset(w, torchfeed.cached(cd.Decoded), n)  # job B: an equal dataset, shares A's cache
    truth = torch.stack([cd.Decoded(n)[i] for i in range(n)])
    kw = dict(batch_size=4)
    first = _batches(a, **kw)
    assert torch.equal(torch.cat(first), truth * 2)
    assert torch.equal(torch.cat(_batches(b, **kw)), truth)  # B receives the decoded samples
    assert _same(_batches(a, **kw), first)  # and A's next epoch is its first


def test_cached_shards_keep_their_samples_from_then(fresh_workers, tmp_path):
    w = fresh_workers(1).addresses
    urls = []
    for s in range(2):
        path = tmp_path / f"shard{s}.txt"
        path.write_text("".join(f"{s * 10 + k}\n" for k in range(3)))
        urls.append(str(path))
    ds = RemoteDataset(w, torchfeed.cached(Shards, then=lines_in_place), urls, cd.shard_lines)
    kw = dict(batch_size=None, num_workers=1, seed=3)
    for _ in range(3):  # decoded and kept, then read back from the cache twice
        got = sorted(int(x[0]) for x in _batches(ds, **kw))  # each sample: 4 equal values
        assert got == [100 + s * 10 + k for s in range(2) for k in range(3)]


class _Arrays:
    """Index 0: a writable array; index 1: a read-only one (as ``np.asarray`` of a PIL image)."""

    def __init__(self, tag: str):
        self.tag = tag  # each test's own entries in this process's cache

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        x = np.arange(6, dtype=np.uint8)
        x.flags.writeable = i == 0
        return x


def _add_100(x: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # torch warns that the array is not writable, and writes
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(x).add_(100)


def test_then_works_on_a_copy_of_arrays_read_only_ones_too():
    ds = torchfeed.cached(_Arrays, then=_add_100)("in-process")
    for i in (0, 1):  # writable, read-only
        assert ds[i].tolist() == [100, 101, 102, 103, 104, 105]
        assert ds[i].tolist() == [100, 101, 102, 103, 104, 105]  # the kept array did not change
        assert ds.sample(i).tolist() == list(range(6))
