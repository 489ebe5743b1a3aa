"""IterableDataset streams: torch's order and values, streams moving on worker loss, resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import torchfeed
from helpers import batches_of, deep_equal, torch_batches
from stream_datasets import Counting, DatasetStateful, StatefulCounting, sum_collate

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("streams,physical", [(3, 2), (1, 2), (4, 1), (2, 2)])
def test_same_batches_as_torch_for_any_number_of_physical_workers(workers2, streams, physical):
    ds = torchfeed.RemoteDataset(workers2[:physical], Counting, 23)
    ours = batches_of(torchfeed.RemoteDataLoader(ds, batch_size=3, num_workers=streams))
    assert deep_equal(ours, torch_batches(Counting(23), batch_size=3, num_workers=streams))


@pytest.mark.parametrize(
    "kw",
    [dict(batch_size=None), dict(batch_size=4, drop_last=True), dict(batch_size=2, collate_fn=sum_collate)],
)
def test_batching_options_like_torch(workers2, kw):
    ds = torchfeed.RemoteDataset(workers2, Counting, 19)
    ours = batches_of(torchfeed.RemoteDataLoader(ds, num_workers=3, **kw))
    assert deep_equal(ours, torch_batches(Counting(19), num_workers=3, **kw))


def test_default_streams_is_the_number_of_workers(workers2):
    ds = torchfeed.RemoteDataset(workers2, Counting, 17)
    ours = batches_of(torchfeed.RemoteDataLoader(ds, batch_size=2))
    assert deep_equal(ours, torch_batches(Counting(17), batch_size=2, num_workers=2))


def test_argument_errors_are_torchs(workers2):
    ds = torchfeed.RemoteDataset(workers2, Counting, 5)
    for kw in (dict(shuffle=True), dict(sampler=[0, 1])):
        with pytest.raises(ValueError, match="IterableDataset") as ours:
            torchfeed.RemoteDataLoader(ds, **kw)
        with pytest.raises(ValueError) as theirs:
            DataLoader(Counting(5), **kw)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.slow
@pytest.mark.parametrize("cls,warns", [(StatefulCounting, False), (Counting, True)])
def test_a_killed_worker_loses_nothing(fresh_workers, cls, warns, recwarn):
    """Streams of a killed worker go on elsewhere: the output is still torch's, exactly."""
    w = fresh_workers(3)
    ds = torchfeed.RemoteDataset(w.addresses, cls, 60, 0.01)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2, num_workers=4, prefetch_factor=1, timeout=60)
    ours = batches_of(loader, at=5, event=lambda: w.kill(1))
    assert deep_equal(ours, torch_batches(cls(60), batch_size=2, num_workers=4))
    replayed = [x for x in recwarn if "drawn again" in str(x.message)]
    assert len(replayed) == (1 if warns else 0)


def _losing_a_worker_keeps_dataset_state(w, seconds: float, num_workers: int, after: int, victim: int):
    """A pass of a dataset-level Stateful iterable in batches of 3 over ``num_workers`` streams,
    worker ``victim`` killed once ``after`` batches arrived: torch's batches all the same."""
    ds = torchfeed.RemoteDataset(w.addresses, DatasetStateful, 40, seconds)
    loader = torchfeed.RemoteDataLoader(
        ds, batch_size=3, num_workers=num_workers, prefetch_factor=1, timeout=60
    )
    ours = batches_of(loader, at=after, event=lambda: w.kill(victim))
    assert deep_equal(ours, torch_batches(DatasetStateful(40), batch_size=3, num_workers=num_workers))


@pytest.mark.slow
def test_dataset_level_state_moves_too(fresh_workers):
    _losing_a_worker_keeps_dataset_state(fresh_workers(2), 0.01, num_workers=2, after=3, victim=0)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [StatefulCounting, Counting])
def test_resume_on_other_workers(workers2, fresh_workers, cls):
    expected = torch_batches(cls(31), batch_size=2, num_workers=3)
    first = torchfeed.RemoteDataLoader(
        torchfeed.RemoteDataset(workers2, cls, 31), batch_size=2, num_workers=3
    )
    head = batches_of(first, stop=4)
    state = first.state_dict()
    other = fresh_workers(1)
    second = torchfeed.RemoteDataLoader(
        torchfeed.RemoteDataset(other.addresses, cls, 31), batch_size=2, num_workers=3
    )
    second.load_state_dict(state)
    rest = list(second)
    assert deep_equal(head + rest, expected)
    again = [b[0] for b in second]  # the next epoch: all of it again (with a new base seed)
    assert deep_equal(again, [b[0] for b in expected])


@pytest.mark.slow
def test_a_cut_connection_moves_the_stream_too(fresh_workers):
    w = fresh_workers(2)
    ds = torchfeed.RemoteDataset(w.addresses, StatefulCounting, 40, 0.01)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2, num_workers=3, prefetch_factor=1, timeout=60)
    ours = batches_of(loader, at=4, event=lambda: torchfeed.client.close_connections([w.addresses[0]]))
    assert deep_equal(ours, torch_batches(StatefulCounting(40), batch_size=2, num_workers=3))


def test_persistent_workers_keep_each_streams_generators(workers2):
    ds = torchfeed.RemoteDataset(workers2, Counting, 12)
    ours = torchfeed.RemoteDataLoader(ds, batch_size=2, num_workers=3, persistent_workers=True)
    theirs = DataLoader(Counting(12), batch_size=2, num_workers=3, persistent_workers=True)
    torch.manual_seed(3)
    mine = [list(ours) for _ in range(2)]
    torch.manual_seed(3)
    assert deep_equal(mine, [list(theirs) for _ in range(2)])


@pytest.mark.slow
def test_resume_in_a_new_process(workers2, tmp_path):
    """The state goes through a checkpoint file; a new process with one new worker finishes the epoch."""
    import subprocess
    import sys

    expected = torch_batches(StatefulCounting(29), batch_size=3, num_workers=3)
    first = torchfeed.RemoteDataLoader(
        torchfeed.RemoteDataset(workers2, StatefulCounting, 29), batch_size=3, num_workers=3
    )
    head = batches_of(first, stop=5)
    torch.save(first.state_dict(), tmp_path / "state.pt")
    script = f"""
import torch, torchfeed
from stream_datasets import StatefulCounting
with torchfeed.LocalWorkers(1) as w:
    loader = torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(w.addresses, StatefulCounting, 29), batch_size=3,
                                        num_workers=3)
    loader.load_state_dict(torch.load({str(tmp_path / "state.pt")!r}))
    torch.save(list(loader), {str(tmp_path / "rest.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=100)
    assert deep_equal(head + torch.load(tmp_path / "rest.pt"), expected)


@pytest.mark.slow
def test_streams_on_one_worker_keep_dataset_state_apart(fresh_workers):
    """Two streams of a dataset-level Stateful iterable on one worker, then moved: nothing mixed up."""
    _losing_a_worker_keeps_dataset_state(fresh_workers(2), 0.005, num_workers=4, after=5, victim=1)


def test_a_pass_left_open_is_closed_at_exit_like_a_map_pass(workers2, monkeypatch):
    """At interpreter exit open passes close before the connections do, iterable ones too:
    their streams are released on the workers, and the loader keeps where the pass stood."""
    import gc

    from torchfeed.loader import plan
    from torchfeed.loader.iterable import IterablePass

    monkeypatch.setattr(plan.live, "exiting", False)  # close_all sets it: undone after the test
    loader = torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(workers2, Counting, 100), batch_size=4)
    passing = iter(loader)
    next(passing)
    running = [p for p in plan.live.passes if isinstance(p, IterablePass)]
    assert len(running) == 1 and not running[0].closed
    plan.live.close_all()  # what atexit runs
    assert running[0].closed and running[0] not in plan.live.passes
    del passing, running
    gc.collect()  # the pass is gone: what the loader saves is the snapshot taken when it closed
    slots = loader.state_dict()["streams"]["slots"]
    assert sum(slot["delivered"] for slot in slots) == 1
