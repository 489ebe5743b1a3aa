"""Worker context: get_worker_info() on the workers, per-pass setup, seeding like torch."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

import torchfeed
from compat_datasets import Info, Random, SlowShards, seed_numpy_like_torch_docs, tag_with_worker
from helpers import deep_equal

pytestmark = pytest.mark.timeout(120)


def pids_of(addresses):
    import os

    return {torchfeed.rpc_async(a, os.getpid, timeout=30).wait(): a for a in addresses}


def test_get_worker_info_in_getitem(workers2):
    ds = torchfeed.RemoteDataset(workers2, Info, 16)
    assert (
        torchfeed.rpc_async(workers2[0], lambda d: d.built_with_info, args=(ds.ref(workers2[0]),)).wait()
        is None
    )
    by_pid = pids_of(workers2)
    rows = torch.cat([x for x, _ in torchfeed.RemoteDataLoader(ds, batch_size=2, shuffle=True)])
    assert sorted(rows[:, 0].tolist()) == list(range(16))
    for _, wid, count, seed, same, initial, pid in rows.tolist():
        assert workers2[wid] == by_pid[pid]  # the id is the worker's position in the dataset's list
        assert count == 2
        assert 0 <= seed < 2**63 and 0 <= initial < 2**63  # collatable, like torch's seeds
        assert same == 1  # info.dataset is the instance that loads
    seeds = {(wid, seed) for _, wid, _, seed, *_ in rows.tolist()}
    assert len(seeds) == 2 and seeds == {(0, min(s for _, s in seeds)), (1, min(s for _, s in seeds) + 1)}


def test_get_worker_info_is_none_outside_of_loading(workers2):
    assert get_worker_info() is None  # the trainer
    assert torchfeed.rpc_async(workers2[0], get_worker_info).wait() is None  # a worker between loads


def test_worker_init_fn_configures_the_instance_that_loads(workers2):
    ds = torchfeed.RemoteDataset(workers2, Info, 12)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=3, worker_init_fn=tag_with_worker)
    for _ in range(2):
        batches = list(loader)
        tags = {tag for _, tags in batches for tag in tags}
        assert tags <= {"init0", "init1"} and tags
        for rows, tags in batches:
            for row, tag in zip(rows.tolist(), tags):
                assert tag == f"init{row[1]}"
                assert row[4] == 1  # info.dataset is what loads: the loader's own copy
    for (
        address
    ) in workers2:  # the workers' instances themselves are untouched; other loaders see them as built
        assert torchfeed.rpc_async(address, lambda d: d.tag, args=(ds.ref(address),)).wait() == "built"
    assert {t for _, tags in torchfeed.RemoteDataLoader(ds, batch_size=4) for t in tags} == {"built"}


def test_per_sample_seeds_are_collatable_and_independent_of_worker_init_fn(workers2):
    ds = torchfeed.RemoteDataset(workers2, Random, 12)
    plain = list(torchfeed.RemoteDataLoader(ds, batch_size=4, seed=7))
    with_init = list(
        torchfeed.RemoteDataLoader(ds, batch_size=4, seed=7, worker_init_fn=seed_numpy_like_torch_docs)
    )
    assert deep_equal(plain, with_init)  # per-sample seeding overrides what worker_init_fn seeded
    seeds = torch.cat(plain)[:, 1]
    assert (seeds >= 0).all() and len(set(seeds.tolist())) == 12  # one seed per sample, in [0, 2**63)


@pytest.mark.slow
@pytest.mark.parametrize("init", [None, seed_numpy_like_torch_docs])
def test_without_per_sample_seeding_one_worker_is_torchs_worker(fresh_workers, init):
    """Seeded with base seed + id at each pass, then worker_init_fn, then samples draw in
    order: with one worker the batches are torch's (num_workers=1), bit for bit."""
    w = fresh_workers(1)
    ds = torchfeed.RemoteDataset(w.addresses, Random, 12)
    ours = torchfeed.RemoteDataLoader(
        ds, batch_size=4, shuffle=True, per_sample_seeding=False, worker_init_fn=init
    )
    for epoch in range(2):
        torch.manual_seed(epoch)
        got = list(ours)
        after = torch.get_rng_state()
        # other calls on the worker between batches must not disturb the pass's stream
        torchfeed.rpc_async(w.addresses[0], lambda: torch.rand(3)).wait()
        torch.manual_seed(epoch)
        expected = list(
            DataLoader(Random(12), batch_size=4, shuffle=True, num_workers=1, worker_init_fn=init)
        )
        assert deep_equal(got, expected)
        assert torch.equal(after, torch.get_rng_state())


@pytest.mark.slow
def test_context_is_per_thread_on_a_parallel_worker(workers2, fresh_workers):
    """One worker process, two loaders at once on two threads, with different worker ids."""
    w = fresh_workers(1, parallel=2)
    shared = w.addresses[0]
    alone = torchfeed.RemoteDataset([shared], Info, 12, 0.02)
    second = torchfeed.RemoteDataset([workers2[0], shared], Info, 12, 0.02)
    results = {}

    def run(name, ds):
        results[name] = torch.cat([x for x, _ in torchfeed.RemoteDataLoader(ds, batch_size=1)])

    threads = [
        threading.Thread(target=run, args=(name, ds)) for name, ds in [("alone", alone), ("second", second)]
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    shared_pid = next(iter(pids_of([shared])))
    assert {(r[1], r[2]) for r in results["alone"].tolist()} == {(0, 1)}
    assert {(r[1], r[2]) for r in results["second"].tolist() if r[6] == shared_pid} == {(1, 2)}


@pytest.mark.slow
def test_iterable_pass_losing_a_worker_moves_its_stream_and_the_next_pass_keeps_two_streams(fresh_workers):
    w = fresh_workers(2)
    ds = torchfeed.RemoteDataset(w.addresses, SlowShards, 40, 0.05)
    it = iter(torchfeed.RemoteDataLoader(ds, batch_size=2, prefetch_factor=1))
    rows = [next(it)[0], next(it)[0]]  # one batch of each stream delivered
    w.kill(1)
    with pytest.warns(UserWarning, match="drawn again"):  # SlowShards has no state: replayed
        rows += [x for x, _ in it]
    assert sorted(torch.cat(rows)[:, 0].tolist()) == list(range(40))  # nothing lost, nothing repeated
    left = torch.cat([x for x, _ in torchfeed.RemoteDataLoader(ds, batch_size=4)])
    assert sorted(left[:, 0].tolist()) == list(range(40))  # both streams, on the worker that is left
    assert set(left[:, 1].tolist()) == {0, 1}  # all the data, from the worker that is left
