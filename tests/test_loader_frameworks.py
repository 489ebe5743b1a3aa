"""What the training frameworks rely on, checked in one process (tests/test_frameworks.py runs
the frameworks themselves): a DataLoader subclass re-creatable from its attributes, passes that
start at the first next(), set_epoch reaching the samplers, worker_init_fn read at every pass,
len() after a resume, and torchfeed.DistributedSampler giving torch's indices."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import DistributedSampler as TorchDistributedSampler

import torchfeed
from helpers import OffsetDataset, RangeDataset, indices


@pytest.fixture
def rds(workers2):
    return torchfeed.RemoteDataset(workers2, RangeDataset, 20)


def test_a_dataloader_that_lightning_can_recreate_with_its_sampler(rds):
    from lightning.fabric.utilities.data import _update_dataloader

    loader = torchfeed.RemoteDataLoader(
        rds, batch_size=4, shuffle=True, seed=5, compression=None, max_retries=1
    )
    assert isinstance(loader, DataLoader)
    sampler: TorchDistributedSampler[Any] = TorchDistributedSampler(
        rds, num_replicas=2, rank=1, shuffle=False
    )
    again = _update_dataloader(loader, sampler)
    assert type(again) is torchfeed.RemoteDataLoader and again.sampler is sampler
    assert (again.seed, again.compression, again.max_retries) == (5, None, 1)
    assert [b[1].tolist() for b in again] == [list(range(1, 20, 2))[i : i + 4] for i in range(0, 10, 4)]


def test_an_unread_iterator_loads_nothing_and_keeps_the_epoch(rds):
    loader = torchfeed.RemoteDataLoader(rds, batch_size=4, seed=1)
    it = iter(loader)
    assert len(it) == 5 and not it.started
    del it
    assert loader.state_dict()["epoch"] == 0 and not loader.state_dict()["active"]
    assert loader.stats().batches == 0
    assert len(list(loader)) == 5 and loader.epoch == 1


def test_the_sampler_epoch_is_read_at_the_first_next(rds):
    sampler = torchfeed.DistributedSampler(rds, num_replicas=1, rank=0, seed=2)
    loader = torchfeed.RemoteDataLoader(rds, batch_size=20, sampler=sampler)
    it = iter(loader)  # Lightning's order: iter(), then set_epoch, then next()
    sampler.set_epoch(3)
    expected: TorchDistributedSampler[int] = TorchDistributedSampler(
        indices(20), num_replicas=1, rank=0, seed=2
    )
    expected.set_epoch(3)
    assert next(it)[1].tolist() == list(expected)


def test_set_epoch_reaches_the_sampler_and_the_batch_samplers_sampler(rds):
    sampler = torchfeed.DistributedSampler(rds, num_replicas=2, rank=0, seed=4)
    loader = torchfeed.RemoteDataLoader(rds, batch_size=4, sampler=sampler)
    loader.set_epoch(6)
    assert sampler.epoch == 6 and loader.epoch == 6
    inner = torchfeed.DistributedSampler(rds, num_replicas=2, rank=0)
    batches = torchfeed.RemoteDataLoader(rds, batch_sampler=torch.utils.data.BatchSampler(inner, 3, False))
    batches.set_epoch(2)
    assert inner.epoch == 2


def _tag(worker_id):
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    assert info is not None
    dataset: Any = info.dataset  # the worker's copy of the user's dataset
    dataset.offset = 1000


def test_worker_init_fn_assigned_after_a_pass_is_used_by_the_next(workers2):

    loader = torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(workers2, OffsetDataset, 6), batch_size=3)
    assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]
    loader.worker_init_fn = _tag  # what Lightning's seed_everything(workers=True) does
    assert [b.tolist() for b in loader] == [[1000, 1001, 1002], [1003, 1004, 1005]]


def test_len_stays_the_epochs_length_after_load_state_dict(rds):
    def make():
        return torchfeed.RemoteDataLoader(
            rds, batch_size=3, sampler=torchfeed.DistributedSampler(rds, 2, 0, seed=1)
        )

    loader = make()
    it = iter(loader)
    first = [next(it)[1].tolist() for _ in range(2)]
    resumed = make()
    resumed.load_state_dict(loader.state_dict())
    rest = [b[1].tolist() for b in resumed]
    assert len(resumed) == len(loader) == 4
    whole = [b[1].tolist() for b in make()]
    assert first + rest == whole


@pytest.mark.parametrize("n,world,drop_last", [(45, 2, False), (45, 4, False), (45, 4, True), (7, 3, False)])
def test_distributed_sampler_gives_torchs_indices(n, world, drop_last):
    for epoch in (0, 5):
        for rank in range(world):
            ours = torchfeed.DistributedSampler(n, world, rank, shuffle=True, seed=9, drop_last=drop_last)
            theirs: TorchDistributedSampler[int] = TorchDistributedSampler(
                indices(n), world, rank, shuffle=True, seed=9, drop_last=drop_last
            )
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
            # resumed after 2 samples, the rest (padding included) is the same
            resumed = torchfeed.DistributedSampler(n, world, rank, shuffle=True, seed=9, drop_last=drop_last)
            resumed.load_state_dict(ours.state_dict(consumed_on_rank=2))
            assert list(resumed) == list(theirs)[2:]


def test_iterable_streams_numbered_across_the_ranks_when_asked(workers2, monkeypatch, caplog):
    from torch.utils.data import IterableDataset

    from helpers import WorkerShare

    ds = torchfeed.RemoteDataset(workers2, WorkerShare, 24)
    assert isinstance(ds, IterableDataset)  # frameworks inject no sampler into its loader
    with pytest.raises(TypeError, match="RemoteDataLoader"):
        iter(ds)
    from torchfeed.loader import checks

    monkeypatch.setattr(checks, "_logged_once", set())  # said once per process: forget earlier tests
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    every = sorted(int(i) for b in torchfeed.RemoteDataLoader(ds, batch_size=4) for i in b)
    assert every == list(range(24))  # by default as torch: every rank reads everything, and is told
    assert "pass rank_streams=True" in caplog.text
    rank1 = sorted(int(i) for b in torchfeed.RemoteDataLoader(ds, batch_size=4, rank_streams=True) for i in b)
    assert rank1 == [i for i in range(24) if i % 4 in (2, 3)]  # streams 2 and 3 of 4


def test_a_state_of_the_older_sampler_seeding_is_refused(rds):
    loader = torchfeed.RemoteDataLoader(rds, batch_size=4, sampler=torchfeed.DistributedSampler(rds, 2, 0))
    it = iter(loader)
    next(it)
    old = {**loader.state_dict(), "format": "torchfeed.RemoteDataLoader/1"}
    with pytest.raises(ValueError, match="older torchfeed"):
        loader.load_state_dict(old)
    plain = torchfeed.RemoteDataLoader(rds, batch_size=4, shuffle=True)
    it = iter(plain)
    next(it)
    state = {**plain.state_dict(), "format": "torchfeed.RemoteDataLoader/1"}
    del state["draws"]  # format 1 had no such key
    resumed = torchfeed.RemoteDataLoader(rds, batch_size=4, shuffle=True)
    resumed.load_state_dict(state)  # no DistributedSampler in it: nothing changed, it resumes
    assert len(list(resumed)) == 4


def test_a_resume_is_exact_when_the_global_generator_is_used_between_iter_and_next(rds):
    torch.manual_seed(0)
    loader = torchfeed.RemoteDataLoader(rds, batch_size=4, shuffle=True)
    it = iter(loader)
    torch.rand(3)  # a framework hook, model code: anything between iter() and next()
    head = [next(it)[1].tolist() for _ in range(2)]
    state = loader.state_dict()
    rest = [b[1].tolist() for b in it]
    torch.manual_seed(1)  # another process's generator
    resumed = torchfeed.RemoteDataLoader(rds, batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    assert [b[1].tolist() for b in resumed] == rest and len(head + rest) == 5


def test_state_dict_after_an_unread_iter_describes_the_pass_about_to_start(rds):
    loader = torchfeed.RemoteDataLoader(rds, batch_size=4)
    it = iter(loader)
    next(it)
    next(it)  # epoch 0 abandoned after 2 batches
    pending = iter(loader)  # made, not read yet (as Lightning does before setting the epoch)
    state = loader.state_dict()
    assert (state["epoch"], state["active"]) == (1, False)
    assert len(list(pending)) == 5


def _pair(samples):
    return [len(samples)] * 2


def test_a_collate_fn_assigned_twice_between_passes_is_the_last_one(rds):
    loader = torchfeed.RemoteDataLoader(rds, batch_size=4, collate_fn=len)
    assert next(iter(loader)) == 4
    loader.collate_fn = lambda samples: -1
    loader.collate_fn = _pair  # the first replacement is freed: its id may be reused
    assert next(iter(loader)) == [4, 4]


@pytest.mark.parametrize("rank, world", [("x", "2"), ("2", "2"), ("1", None)])
def test_an_invalid_rank_in_the_environment_is_one_clear_error_for_the_sampler_and_the_loader(
    monkeypatch, rank, world
):
    """The job's ranks are read in one place: the sampler and the loader's checks refuse the same
    RANK/WORLD_SIZE with the same message."""
    from torchfeed.loader import checks

    monkeypatch.setenv("RANK", rank)
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=r"RANK must be an integer in \[0, WORLD_SIZE\)") as sampler:
        torchfeed.DistributedSampler(8)
    with pytest.raises(ValueError, match=r"RANK must be an integer in \[0, WORLD_SIZE\)") as loader:
        checks.job_ranks()
    assert str(sampler.value) == str(loader.value) and repr(rank) in str(loader.value)
    assert (
        torchfeed.DistributedSampler(8, num_replicas=2, rank=1).rank == 1
    )  # given: the environment is not read
