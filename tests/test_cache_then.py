"""A cached dataset's ``then`` cannot change what is kept (real worker processes)."""

from __future__ import annotations

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
