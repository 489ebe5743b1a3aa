"""RemoteDataLoader against torch's DataLoader, with real worker processes."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, SubsetRandomSampler

import torchfeed
from helpers import DictDataset, FailingDataset, RangeDataset, SleepDataset, deep_equal
from torchfeed.protocol import buffers
from torchfeed.util import free_port

N = 53


@pytest.fixture(scope="module")
def rds(workers2):
    return torchfeed.RemoteDataset(workers2, RangeDataset, N)


def both(rds, local, **kw):
    torch.manual_seed(1234)
    remote = list(torchfeed.RemoteDataLoader(rds, **kw))
    torch.manual_seed(1234)
    kw.pop("prefetch_factor", None)  # torch only takes it with local worker processes
    expected = list(DataLoader(local, **kw))
    return remote, expected


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(batch_size=8),
        dict(batch_size=8, drop_last=True),
        dict(batch_size=8, shuffle=True),
        dict(batch_size=None),
        dict(batch_size=None, shuffle=True),
        dict(batch_size=5, collate_fn=lambda b: [x[1] * 10 for x in b]),
        dict(batch_size=4, sampler=SubsetRandomSampler(list(range(0, N, 3)))),
        dict(batch_sampler=BatchSampler(SequentialSampler(range(N)), 6, drop_last=False)),
        dict(batch_size=7, prefetch_factor=1),
        dict(batch_size=7, prefetch_factor=6),
    ],
)
def test_same_batches_as_torch(rds, kw):
    remote, expected = both(rds, RangeDataset(N), **kw)
    assert len(remote) == len(expected)
    assert deep_equal(remote, expected)


def test_len_matches_torch(rds):
    settings: list[dict[str, Any]] = [
        dict(batch_size=8),
        dict(batch_size=8, drop_last=True),
        dict(batch_size=None),
    ]
    for kw in settings:
        assert len(torchfeed.RemoteDataLoader(rds, **kw)) == len(DataLoader(RangeDataset(N), **kw))


def test_nested_structures_and_numpy(workers2):
    rds = torchfeed.RemoteDataset(workers2, DictDataset, 10)
    remote, expected = both(rds, DictDataset(10), batch_size=3)
    assert deep_equal(remote, expected)


def test_generator_argument_gives_torch_order(rds):
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    remote = list(torchfeed.RemoteDataLoader(rds, batch_size=4, shuffle=True, generator=g1))
    expected = list(DataLoader(RangeDataset(N), batch_size=4, shuffle=True, generator=g2))
    assert deep_equal(remote, expected)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(sampler=[0, 1], shuffle=True), "sampler option is mutually exclusive with shuffle"),
        (dict(batch_sampler=[[0]], batch_size=2), "batch_sampler option is mutually exclusive"),
        (dict(batch_sampler=[[0]], shuffle=True), "batch_sampler option is mutually exclusive"),
        (dict(batch_sampler=[[0]], drop_last=True), "batch_sampler option is mutually exclusive"),
        (dict(batch_size=None, drop_last=True), "batch_size=None option disables auto-batching"),
        (dict(timeout=-1), "timeout option should be non-negative"),
    ],
)
def test_conflicting_arguments_raise_like_torch(rds, kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as ours:
        torchfeed.RemoteDataLoader(rds, **kw)
    with pytest.raises(ValueError) as theirs:
        DataLoader(RangeDataset(N), **kw)
    assert str(ours.value) == str(theirs.value)


def test_break_and_iterate_again(rds):
    loader = torchfeed.RemoteDataLoader(rds, batch_size=4)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert deep_equal(list(loader), list(DataLoader(RangeDataset(N), batch_size=4)))
    assert deep_equal(list(loader), list(DataLoader(RangeDataset(N), batch_size=4)))


def test_two_loaders_interleaved_on_same_workers(rds):
    a = iter(torchfeed.RemoteDataLoader(rds, batch_size=3))
    b = iter(torchfeed.RemoteDataLoader(rds, batch_size=5, collate_fn=lambda s: sum(x[1] for x in s)))
    got_a, got_b = [], []
    for y in b:  # alternate between the two passes
        got_b.append(y)
        got_a.append(next(a))
    got_a.extend(a)
    assert deep_equal(got_a, list(DataLoader(RangeDataset(N), batch_size=3)))
    assert got_b == [sum(range(i, min(i + 5, N))) for i in range(0, N, 5)]


@pytest.mark.filterwarnings("ignore:torchfeed.RPC:FutureWarning")  # the seed's names are deprecated
@pytest.mark.parametrize("name", ["RemoteDataLoader", "RPCDataloader"])
def test_seed_form_builds_dataset(workers2, name):
    loader = getattr(torchfeed, name)(workers=workers2, dataset=RangeDataset, kwargs={"n": 9}, batch_size=4)
    assert isinstance(loader.dataset, torchfeed.RemoteDataset)
    assert deep_equal(list(loader), list(DataLoader(RangeDataset(9), batch_size=4)))


def test_local_class_and_lambda_transform(workers2):
    class Squares(torch.utils.data.Dataset):  # defined here: must travel by value
        def __init__(self, n, transform):
            self.n, self.transform = n, transform

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return self.transform(torch.tensor(i))

    rds = torchfeed.RemoteDataset(workers2, Squares, 10, transform=lambda t: t * t)
    assert torch.equal(torch.cat(list(torchfeed.RemoteDataLoader(rds, batch_size=3))), torch.arange(10) ** 2)


def test_remote_exception_names_worker_type_traceback_and_indices(workers2):
    rds = torchfeed.RemoteDataset(workers2, FailingDataset, 20, bad=[13])
    loader = torchfeed.RemoteDataLoader(rds, batch_size=4)
    it = iter(loader)
    got = [next(it) for _ in range(3)]  # batches 0..2 are fine and come first, in order
    assert [int(b[1][0]) for b in got] == [0, 4, 8]
    with pytest.raises(torchfeed.RemoteError) as info:
        next(it)
    err = info.value
    assert err.remote_type == "KeyError"
    assert err.address in workers2
    assert err.indices == [12, 13, 14, 15]
    assert "sample 13 is corrupt" in err.remote_traceback
    assert "__getitem__" in err.remote_traceback
    # the loader goes on after the failed batch, like torch's
    assert deep_equal(
        next(it),
        next(iter(DataLoader(torch.utils.data.Subset(RangeDataset(20), range(16, 20)), batch_size=4))),
    )


def test_dataset_constructor_error_is_remote_error(workers2):
    with pytest.raises(torchfeed.RemoteError, match="TypeError"):
        torchfeed.RemoteDataset(workers2, RangeDataset, "not a number", bogus=1)


def test_unreachable_worker_is_retried_until_timeout(monkeypatch):
    port = free_port()  # nothing listens there now
    monkeypatch.setattr(torchfeed.RemoteDataset, "timeout", 1.0)
    with pytest.raises(
        torchfeed.WorkerLost,
        match=rf"127.0.0.1:{port}: the connection was refused for "
        r"\d+\.\d s \(\d+ attempts, retried until timeout=1 s\)",
    ):
        torchfeed.RemoteDataset([f"127.0.0.1:{port}"], RangeDataset, 5)


@pytest.mark.slow
def test_least_loaded_not_round_robin(fresh_workers):
    w = fresh_workers(3)
    slow_pid = w.processes[0].pid
    rds = torchfeed.RemoteDataset(w.addresses, SleepDataset, 90, 0.01, {slow_pid: 8}, with_pid=True)
    got = list(torchfeed.RemoteDataLoader(rds, batch_size=1, straggler_factor=None))  # no duplicates
    assert [int(x[1]) for x in got] == list(range(90))  # in order, each once
    pids = [int(x[2]) for x in got]
    # round robin would give each worker 30 batches; the 8x slower one must get far fewer
    assert pids.count(slow_pid) < 15
    assert set(pids) == {p.pid for p in w.processes}


@pytest.mark.slow
def test_several_trainer_processes_share_workers(workers2, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, torch, torchfeed\n"
        "from helpers import RangeDataset\n"
        "ds = torchfeed.RemoteDataset(sys.argv[1:], RangeDataset, 40)\n"
        "total = sum(int(y.sum()) for _, y in torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True))\n"
        "print(total)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, str(script), *workers2], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs == [str(sum(range(40)))] * 3
    assert all(p.returncode == 0 for p in procs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory); CI has no GPU")
def test_pin_memory_receives_into_pinned_memory(rds):
    for x, y in torchfeed.RemoteDataLoader(rds, batch_size=8, pin_memory=True):
        assert x.is_pinned() and y.is_pinned()
        assert torch.equal(x.cuda(non_blocking=True).cpu(), x)


def test_pin_memory_without_cuda_warns_and_works(rds):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: nothing to warn about")

    buffers._warned_pin = False
    with pytest.warns(UserWarning, match="CUDA is not available"):
        got = list(torchfeed.RemoteDataLoader(rds, batch_size=8, pin_memory=True))
    assert deep_equal(got, list(DataLoader(RangeDataset(N), batch_size=8)))
