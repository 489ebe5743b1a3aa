"""Per-sample seeding and exact mid-epoch resume, whatever the workers."""

from __future__ import annotations

import pickle
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SubsetRandomSampler

import torchfeed
from helpers import RandomAugmentDataset, RangeDataset, deep_equal, indices
from torchfeed.loader.sampling import DistributedSampler, mix_seed

N = 48


def run(addresses, n=N, epochs=1, **kw):
    ds = torchfeed.RemoteDataset(addresses, RandomAugmentDataset, n)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4, **kw)
    return [torch.stack(list(loader)) for _ in range(epochs)]


@pytest.fixture(scope="module")
def three(fresh_workers_module):
    return fresh_workers_module(3)


@pytest.fixture(scope="module")
def fresh_workers_module():
    made = []

    def make(n):
        w = torchfeed.LocalWorkers(n)
        made.append(w)
        return w.addresses

    yield make
    for w in made:
        w.close()


def test_mix_seed_is_well_mixed():
    assert mix_seed(1, 2) != mix_seed(2, 1)
    assert mix_seed(0, 0, 1) != mix_seed(0, 1, 0)
    seeds = {mix_seed(7, 0, i) for i in range(10000)}
    assert len(seeds) == 10000
    # neighbouring indices differ in about half of their bits
    flips = [bin(mix_seed(7, 0, i) ^ mix_seed(7, 0, i + 1)).count("1") for i in range(1000)]
    assert 28 < sum(flips) / len(flips) < 36


def test_seed_all_gives_each_generator_its_own_documented_seed():
    import random

    import numpy as np

    from torchfeed.seeding import INT63, extend_seed, seed_all

    assert extend_seed(mix_seed(3), 99) == mix_seed(3, 99)  # a prefix mixed once
    for seed in (0, 1, 2**64 - 1, mix_seed(5, 7)):
        seed_all(seed)
        drawn = (random.random(), float(np.random.rand()), float(torch.rand(())))
        random.seed(mix_seed(seed, 1))
        np.random.seed(mix_seed(seed, 2) & 0xFFFFFFFF)  # numpy's integer seeding takes 32 bits
        torch.manual_seed(mix_seed(seed, 3) & INT63)
        assert drawn == (random.random(), float(np.random.rand()), float(torch.rand(())))
        seed_all(seed)
        assert torch.initial_seed() == mix_seed(seed, 3) & INT63


def test_same_seed_same_batches_any_number_of_workers(workers2, three):
    one = run(workers2[:1], seed=5, shuffle=True, epochs=2)
    many = run(three, seed=5, shuffle=True, epochs=2)
    assert deep_equal(one, many)
    assert not torch.equal(one[0], one[1])  # epochs differ (order and draws)
    other = run(three, seed=6, shuffle=True)
    assert not torch.equal(other[0], one[0])


def test_draws_depend_on_sample_not_on_position(workers2):
    ordered = run(workers2, seed=3)[0].reshape(-1, 4)
    shuffled = run(workers2, seed=3, shuffle=True)[0].reshape(-1, 4)
    # the same sample gets different draws in different epochs only: same epoch 0 here
    by_index = {int(r[0]): r for r in ordered}
    assert all(torch.equal(by_index[int(r[0])], r) for r in shuffled)
    # and the three generators give distinct values
    assert len({float(x) for x in ordered[:, 1:].flatten()}) == ordered[:, 1:].numel()


def test_same_global_seed_without_seed_argument(workers2, three):
    torch.manual_seed(11)
    a = run(workers2[:1], shuffle=True)
    torch.manual_seed(11)
    b = run(three, shuffle=True)
    assert deep_equal(a, b)


@pytest.mark.slow
def test_killed_worker_does_not_change_batches(workers2, fresh_workers):
    expected = run(workers2, seed=9)[0]
    w = fresh_workers(3)
    ds = torchfeed.RemoteDataset(w.addresses, RandomAugmentDataset, N, 0.01)
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, b in enumerate(torchfeed.RemoteDataLoader(ds, batch_size=4, seed=9)):
            got.append(b)
            if i == 2:
                w.kill(1)
    assert torch.equal(torch.stack(got), expected)


def test_worker_rng_state_is_restored(workers2):
    addr = workers2[0]
    before = torchfeed.rpc_async(addr, lambda: torch.get_rng_state()).wait()
    run([addr], seed=1)
    after = torchfeed.rpc_async(addr, lambda: torch.get_rng_state()).wait()
    assert torch.equal(before, after)


SAMPLERS: dict[str, Callable[[], dict[str, Any]]] = {
    "shuffle+seed": lambda: dict(shuffle=True, seed=4),
    "shuffle+global": lambda: dict(shuffle=True),
    "generator": lambda: dict(shuffle=True, generator=torch.Generator().manual_seed(3)),
    "RandomSampler(generator)": lambda: dict(
        sampler=RandomSampler(range(N), generator=torch.Generator().manual_seed(8))
    ),
    "SubsetRandomSampler": lambda: dict(sampler=SubsetRandomSampler(list(range(0, N, 2)))),
    "torch DistributedSampler": lambda: dict(
        sampler=torch.utils.data.DistributedSampler(indices(N), 2, 1, seed=2)
    ),
    "batch_sampler": lambda: dict(
        batch_sampler=BatchSampler(RandomSampler(range(N)), 5, False), batch_size=1
    ),
    "torchfeed DistributedSampler": lambda: dict(sampler=DistributedSampler(N, 2, 0, seed=3), seed=1),
}


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_resume_after_k_batches_on_other_workers(name, workers2, three):
    def make(addresses):
        kw = SAMPLERS[name]()
        bs = kw.pop("batch_size", 4)
        if "batch_sampler" in kw:
            bs = 1
        ds = torchfeed.RemoteDataset(addresses, RandomAugmentDataset, N)
        return torchfeed.RemoteDataLoader(ds, batch_size=bs, **kw)

    torch.manual_seed(100)
    full = list(make(workers2))
    torch.manual_seed(100)
    loader = make(workers2)
    head, state = [], None
    for i, b in enumerate(loader):
        head.append(b)
        if i == 2:
            state = pickle.loads(pickle.dumps(loader.state_dict()))  # plain data
            break
    torch.manual_seed(12345)  # the resumed job's global generator is somewhere else
    resumed_loader = make(three)
    resumed_loader.load_state_dict(state)
    rest = list(resumed_loader)
    assert deep_equal(head + rest, full)


def test_state_is_small_plain_data(workers2):
    loader = torchfeed.RemoteDataLoader(
        torchfeed.RemoteDataset(workers2, RangeDataset, 1000), batch_size=8, shuffle=True
    )
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    raw = pickle.dumps(state)
    assert len(raw) < 20000
    assert all(isinstance(v, (int, str, bytes, bool, dict, type(None))) for v in state.values())


def test_epoch_advances_and_set_epoch(workers2):
    ds = torchfeed.RemoteDataset(workers2, RandomAugmentDataset, 16)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True, seed=2)
    e0, e1 = torch.cat(list(loader)), torch.cat(list(loader))
    assert loader.epoch == 2
    loader.set_epoch(1)
    assert torch.equal(torch.cat(list(loader)), e1)
    loader.set_epoch(0)
    assert torch.equal(torch.cat(list(loader)), e0)


@pytest.mark.slow
def test_resume_in_a_new_process_with_other_workers(workers2, three, tmp_path):
    ds = torchfeed.RemoteDataset(workers2, RandomAugmentDataset, N)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True, seed=21)
    full = torch.cat(list(loader))
    loader.set_epoch(0)
    it = iter(loader)
    head = torch.cat([next(it) for _ in range(5)])
    torch.save({"loader": loader.state_dict()}, tmp_path / "ckpt.pt")
    script = (
        "import sys, torch, torchfeed\n"
        "from helpers import RandomAugmentDataset\n"
        f"ds = torchfeed.RemoteDataset(sys.argv[1:], RandomAugmentDataset, {N})\n"
        "loader = torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True, seed=21)\n"
        f"loader.load_state_dict(torch.load(r'{tmp_path / 'ckpt.pt'}')['loader'])\n"
        f"torch.save(torch.cat(list(loader)), r'{tmp_path / 'rest.pt'}')\n"
    )
    subprocess.run([sys.executable, "-c", script, *three], check=True, timeout=60)
    assert torch.equal(torch.cat([head, torch.load(tmp_path / "rest.pt")]), full)


@pytest.mark.parametrize("old_world, new_world", [(2, 3), (3, 2), (2, 1)])
def test_elastic_sampler_exactly_once_after_resize(old_world, new_world):
    n, seen = 50, []
    old = [DistributedSampler(n, old_world, r, seed=4, pad=False) for r in range(old_world)]
    iters = [iter(s) for s in old]
    for _ in range(7):  # every rank consumed 7 samples
        for it in iters:
            seen.append(next(it))
    state = old[0].state_dict(consumed_on_rank=7)
    new = [DistributedSampler(n, new_world, r, pad=False) for r in range(new_world)]
    for s in new:
        s.load_state_dict(state)
        seen.extend(s)
    assert sorted(seen) == list(range(n))


def test_elastic_sampler_pads_like_torch():
    ours = [list(DistributedSampler(10, 3, r, shuffle=False)) for r in range(3)]
    assert [len(x) for x in ours] == [4, 4, 4]
    theirs: list[list[int]] = [
        list(torch.utils.data.DistributedSampler(indices(10), 3, r, shuffle=False)) for r in range(3)
    ]
    assert ours == theirs
    assert set(sum(ours, [])) == set(range(10))
    dropped = [list(DistributedSampler(10, 3, r, shuffle=False, drop_last=True)) for r in range(3)]
    assert [len(x) for x in dropped] == [3, 3, 3]


def test_set_random_seeds_seed_name(workers2):
    ds = torchfeed.RemoteDataset(workers2, RangeDataset, 4)
    ds.run_on_workers(torchfeed.set_random_seeds, 123, pass_worker_id=True)
    draws = ds.run_on_workers(lambda: float(torch.rand(())))
    again = ds.run_on_workers(torchfeed.set_random_seeds, 123, pass_worker_id=True)
    assert set(again.values()) == {None}
    redraws = ds.run_on_workers(lambda: float(torch.rand(())))
    assert draws == redraws
    assert len(set(draws.values())) == 2  # distinct per worker
