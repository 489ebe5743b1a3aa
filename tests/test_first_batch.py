"""A pass's first batch is split across the workers and joined into what torch would give."""

from __future__ import annotations

import collections
import os
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, default_collate

from torchfeed import LocalWorkers, RemoteDataLoader, RemoteDataset
from torchfeed.loader import split

Point = collections.namedtuple("Point", "x label")


def sample_of(kind: str, i: int):
    t = torch.arange(3, dtype=torch.float32) + i
    return {
        "tensor": t,
        "tuple": (t, i, f"s{i}"),
        "dict": {"a": t, "b": float(i), "c": [t, str(i)]},
        "named": Point(t, i),
        "string": f"item {i}",
        "scalar": i,
    }[kind]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["tensor", "tuple", "dict", "named", "string", "scalar"]),
    size=st.integers(1, 20),
    workers=st.integers(1, 6),
)
def test_joined_parts_equal_the_whole_batch_collated(kind, size, workers):
    samples = [sample_of(kind, i) for i in range(size)]
    parts = split.parts_of(list(range(size)), workers)
    assert [k for p in parts for k in p] == list(range(size))  # contiguous, in order, all
    assert len(parts) == min(workers, size) and max(map(len, parts)) - min(map(len, parts)) <= 1
    joined = split.join([default_collate([samples[k] for k in part]) for part in parts])
    assert same(joined, default_collate(samples))


class Tagged(torch.Tensor):
    """A tensor subclass of the user's: torch's functions keep the type."""


@pytest.mark.parametrize(
    "parts",
    [
        [
            torch.arange(6, dtype=torch.bfloat16).view(2, 3),
            torch.ones(1, 3, dtype=torch.bfloat16),
        ],  # no numpy dtype
        [torch.arange(6.0).view(3, 2).t(), torch.zeros(1, 3)],  # a strided view
        [
            torch.ones(2, 2, dtype=torch.complex64).conj(),
            torch.zeros(1, 2, dtype=torch.complex64),
        ],  # conj bit
        [torch.tensor([[1, 2]]), torch.tensor([[3.5, 4.0]])],  # mixed dtypes: torch.cat promotes
        [Tagged(torch.ones(2, 2)), Tagged(torch.zeros(1, 2))],  # a subclass stays one
        [torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last)[:, :, :, 0], torch.zeros(1, 3, 4)],
    ],
)
def test_a_joined_tensor_is_torch_cat_of_its_parts(parts):
    joined, expected = split.join(parts), torch.cat(parts)
    assert type(joined) is type(expected) and joined.dtype == expected.dtype and torch.equal(joined, expected)
    assert joined.is_contiguous() and joined.data_ptr() not in {p.data_ptr() for p in parts}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host memory); CI has no GPU")
def test_a_batch_joined_from_pinned_parts_is_pinned():
    parts = [torch.ones(2, 3).pin_memory(), torch.zeros(1, 3).pin_memory()]
    joined = split.join(parts)
    assert joined.is_pinned() and torch.equal(joined, torch.cat(parts))


class Timed(torch.utils.data.Dataset):
    """Each sample names the worker process that loaded it."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        time.sleep(0.002)
        return torch.tensor([i, os.getpid()])


def test_the_first_batch_is_loaded_by_every_worker_and_equals_torchs():
    with LocalWorkers(2) as workers:
        pids = {p.pid for p in workers.processes}
        loader = RemoteDataLoader(RemoteDataset(workers.addresses, Timed), batch_size=16, shuffle=True)
        torch.manual_seed(7)
        order = [b[:, 0].tolist() for b in DataLoader(Timed(), batch_size=16, shuffle=True)]
        torch.manual_seed(7)
        batches = list(loader)
        assert [b[:, 0].tolist() for b in batches] == order
        assert set(batches[0][:, 1].tolist()) == pids  # both workers built a part of it
        assert len(batches) == len(loader) == 3


def first_collate(batch):
    return default_collate(batch)


def test_a_custom_collate_is_never_split():
    with LocalWorkers(2) as workers:
        loader = RemoteDataLoader(
            RemoteDataset(workers.addresses, Timed), batch_size=16, collate_fn=first_collate
        )
        first = next(iter(loader))
        assert len(set(first[:, 1].tolist())) == 1  # one worker built it whole


class Held(torch.utils.data.Dataset):
    """Its first sample takes a while: a worker can be killed while it builds its part."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        if i == 0:
            time.sleep(0.5)
        return torch.tensor([i])


@pytest.mark.timeout(300)
def test_a_worker_lost_while_it_builds_a_part_of_the_first_batch_loses_nothing():
    with LocalWorkers(2) as workers:
        loader = RemoteDataLoader(RemoteDataset(workers.addresses, Held), batch_size=10)
        it = iter(loader)
        got: dict = {}
        taker = threading.Thread(target=lambda: got.update(first=next(it)))
        taker.start()
        time.sleep(0.2)  # (when it dies does not matter to the outcome: nothing may be lost)
        workers.kill(0)
        taker.join(240)
        seen = got["first"][:, 0].tolist() + [v for b in it for v in b[:, 0].tolist()]
        assert seen == list(range(40))
