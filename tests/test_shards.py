"""torchfeed.datasets.Shards: shards handed to streams on demand, exactly once per epoch."""

from __future__ import annotations

import functools
import os
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

import torchfeed
from stream_datasets import SlowLines, text_lines, wds_samples
from torchfeed.datasets import Shards

pytestmark = pytest.mark.timeout(120)


def make_shards(root, count=8, per_shard=10):
    urls, every = [], []
    for s in range(count):
        path = os.path.join(root, f"shard-{s:03d}.txt")
        rows = [f"s{s}-{k}" for k in range(per_shard)]
        with open(path, "w") as f:
            f.write("\n".join(rows) + "\n")
        urls.append(path)
        every += rows
    return urls, every


def flat(batches):
    return [x for b in batches for x in b]


def pids_of(addresses):
    return {a: torchfeed.rpc_async(a, os.getpid, timeout=30).wait() for a in addresses}


@pytest.mark.parametrize("kw", [dict(), dict(shuffle=True, seed=3, shuffle_buffer=4)])
def test_every_sample_once_with_more_streams_than_workers(workers2, tmp_path, kw):
    urls, every = make_shards(str(tmp_path))
    ds = torchfeed.RemoteDataset(workers2, Shards, urls, text_lines, **kw)
    got = flat(torchfeed.RemoteDataLoader(ds, batch_size=4, num_workers=3))
    assert Counter(got) == Counter(every)


def test_seeded_shuffle_changes_with_the_epoch_and_replays(workers2, tmp_path):
    urls, every = make_shards(str(tmp_path), count=6, per_shard=6)
    ds = torchfeed.RemoteDataset(workers2, Shards, urls, text_lines, shuffle=True, shuffle_buffer=5)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=None, num_workers=1, seed=11)
    first, second = list(loader), list(loader)
    assert Counter(first) == Counter(every) == Counter(second) and first != second
    loader.set_epoch(0)
    assert list(loader) == first  # one stream: the order is (seed, epoch)'s


def test_pattern_and_torch_dataloader(tmp_path):
    urls, every = make_shards(str(tmp_path), count=5)
    ds = Shards(str(tmp_path / "shard-*.txt"), text_lines, shuffle=True, seed=1, shuffle_buffer=3)
    assert ds.urls == urls
    got = flat(DataLoader(ds, batch_size=3, num_workers=2))  # static split: stream i takes every K-th shard
    assert Counter(got) == Counter(every)


@pytest.mark.slow
def test_a_slow_worker_takes_fewer_shards(fresh_workers, tmp_path):
    urls, every = make_shards(str(tmp_path), count=16, per_shard=5)
    w = fresh_workers(2)
    slow, fast = pids_of(w.addresses).values()
    ds = torchfeed.RemoteDataset(w.addresses, Shards, urls, SlowLines(slow, 0.03))
    batches = list(torchfeed.RemoteDataLoader(ds, batch_size=5, num_workers=2))
    pids = torch.cat([b[0] for b in batches]).tolist()
    assert Counter(flat(b[1] for b in batches)) == Counter(every)
    assert pids.count(fast) > 2 * pids.count(slow)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(shuffle=True, shuffle_buffer=4)])
def test_a_killed_worker_loses_no_shard_and_repeats_none(fresh_workers, tmp_path, kw):
    urls, every = make_shards(str(tmp_path), count=12, per_shard=10)
    w = fresh_workers(3, parallel=2)  # a stream's requests may run out of order
    ds = torchfeed.RemoteDataset(w.addresses, Shards, urls, SlowLines(every=0.005), **kw)
    got = []
    for batch in torchfeed.RemoteDataLoader(ds, batch_size=4, num_workers=4, timeout=60):
        got += batch[1]
        if len(got) == 20:
            w.kill(1)
    assert Counter(got) == Counter(every)


@pytest.mark.slow
def test_resume_mid_epoch_on_other_workers(workers2, fresh_workers, tmp_path):
    urls, every = make_shards(str(tmp_path), count=10, per_shard=7)
    args = (urls, text_lines)
    first = torchfeed.RemoteDataLoader(
        torchfeed.RemoteDataset(workers2, Shards, *args, shuffle_buffer=3),
        batch_size=4,
        num_workers=3,
        seed=5,
    )
    head = []
    for batch in first:
        head += batch
        if len(head) >= 24:
            break
    state = first.state_dict()
    other = fresh_workers(1)
    second = torchfeed.RemoteDataLoader(
        torchfeed.RemoteDataset(other.addresses, Shards, *args, shuffle_buffer=3),
        batch_size=4,
        num_workers=3,
        seed=5,
    )
    second.load_state_dict(state)
    rest = flat(second)
    assert Counter(head + rest) == Counter(every)


@pytest.mark.slow
def test_shards_over_s3(workers2, tmp_path):
    from s3server import S3Server

    s3 = S3Server.shared()
    _urls, every = make_shards(str(tmp_path), count=4, per_shard=5)
    prefix = s3.new_prefix()
    s3.filesystem().put(str(tmp_path) + "/", f"{prefix}/shards/", recursive=True)
    opts = s3.storage_options
    ds = torchfeed.RemoteDataset(
        workers2,
        Shards,
        f"s3://{prefix}/shards/shard-*.txt",
        functools.partial(text_lines, storage_options=opts),
        storage_options=opts,
    )
    got = flat(torchfeed.RemoteDataLoader(ds, batch_size=3, num_workers=3))
    assert Counter(got) == Counter(every)


def test_webdataset_tar_shards(workers2, tmp_path):
    wds = pytest.importorskip("webdataset")
    urls, keys = [], []
    for s in range(4):
        url = str(tmp_path / f"part-{s}.tar")
        with wds.TarWriter(url) as sink:
            for k in range(6):
                key = f"{s:02d}{k:04d}"
                sink.write({"__key__": key, "txt": str(s * 100 + k)})
                keys.append(key)
        urls.append(url)
    ds = torchfeed.RemoteDataset(workers2, Shards, urls, wds_samples, shuffle=True, seed=2)
    batches = list(torchfeed.RemoteDataLoader(ds, batch_size=4, num_workers=2))
    got = flat(b[0] for b in batches)
    assert Counter(got) == Counter(keys)
    assert all(int(v) == int(k[:2]) * 100 + int(k[2:]) for b in batches for k, v in zip(b[0], b[1]))
