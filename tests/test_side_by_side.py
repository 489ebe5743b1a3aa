"""The same dataset and arguments through torch's DataLoader and RemoteDataLoader, compared.

Every batch (types, dtypes, shapes, values), ``len()``, the exception raised (and after
how many batches) and torch's global RNG state afterwards must be the same, over
samplers, collates, dtypes, sample keys and errors. Map-style cases are compared with
torch's single-process loading (exceptions keep their exact type there); iterable-style
cases with torch's ``num_workers=2``, since the split among workers is the point.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data._utils.collate import default_collate, default_convert

import torchfeed
from compat_datasets import (
    Batched,
    Keyed,
    Plain,
    Shards,
    Span,
    Typed,
    dict_collate,
    failing_collate,
    split_span,
)
from helpers import deep_equal

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def remote(workers2):
    built = {}

    def get(cls, *args):
        key = (cls.__name__, repr(args))
        if key not in built:
            built[key] = torchfeed.RemoteDataset(workers2, cls, *args)
        return built[key]

    return get


def outcome(loader):
    """(batches, exception or None, global RNG state afterwards)."""
    batches = []
    try:
        for batch in loader:
            batches.append(batch)
        error = None
    except Exception as exc:  # noqa: BLE001 - compared below
        error = exc
    return batches, error, torch.get_rng_state()


def compare(ours_loader, torch_loader_factory, map_style=True):
    """Run both from the same global seed; assert everything observable is the same."""
    torch.manual_seed(1234)
    batches, error, rng = outcome(ours_loader)
    torch.manual_seed(1234)
    theirs = torch_loader_factory()
    t_batches, t_error, t_rng = outcome(theirs)
    try:
        t_len = len(theirs)
    except TypeError:
        t_len = None
    if t_len is not None:
        assert len(ours_loader) == t_len
    assert len(batches) == len(t_batches), "a different number of batches before the end or the error"
    assert deep_equal(batches, t_batches)
    if t_error is None:
        assert error is None, f"torch raised nothing, we raised {error!r}"
    else:
        assert isinstance(error, type(t_error)), f"torch raised {t_error!r}, we raised {error!r}"
        assert isinstance(error, torchfeed.RemoteError)
        assert str(t_error).strip().splitlines()[-1] in str(error)  # torch's workers wrap the message
        assert error.indices or not map_style, "the failed batch's sample indices"
    assert torch.equal(rng, t_rng), "the global RNG was consumed differently"
    return batches, error


# Each case makes fresh keyword arguments (samplers and generators hold state).
SAMPLERS: dict[str, Callable[[], dict[str, Any]]] = {
    "default": lambda: {},
    "batch": lambda: dict(batch_size=8),
    "drop_last": lambda: dict(batch_size=8, drop_last=True),
    "shuffle": lambda: dict(batch_size=5, shuffle=True),
    "shuffle_generator": lambda: dict(batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(3)),
    "no_batching": lambda: dict(batch_size=None),
    "no_batching_shuffle": lambda: dict(batch_size=None, shuffle=True),
    "subset_random": lambda: dict(batch_size=4, sampler=SubsetRandomSampler(range(0, 23, 2))),
    "weighted": lambda: dict(batch_size=4, sampler=WeightedRandomSampler([1.0] * 20 + [5.0] * 3, 30)),
    "batch_sampler": lambda: dict(batch_sampler=BatchSampler(RandomSampler(range(23)), 6, drop_last=False)),
    "repeats": lambda: dict(batch_size=2, sampler=[22, 0, 5, 5, 1]),
    "sequential_batch_sampler": lambda: dict(
        batch_sampler=BatchSampler(SequentialSampler(range(23)), 7, True)
    ),
}


@pytest.mark.parametrize("case", list(SAMPLERS))
def test_samplers(remote, case):
    compare(
        torchfeed.RemoteDataLoader(remote(Plain), **SAMPLERS[case]()),
        lambda: DataLoader(Plain(), **SAMPLERS[case]()),
    )


COLLATES: dict[str, Callable[[], dict[str, Any]]] = {
    "dict": lambda: dict(batch_size=4, collate_fn=dict_collate),
    "identity": lambda: dict(batch_size=3, collate_fn=lambda batch: batch),
    "convert": lambda: dict(batch_size=4, collate_fn=default_convert),
    "collate_unbatched": lambda: dict(batch_size=None, collate_fn=default_collate),
}


@pytest.mark.parametrize("case", list(COLLATES))
def test_collates(remote, case):
    compare(
        torchfeed.RemoteDataLoader(remote(Plain), **COLLATES[case]()),
        lambda: DataLoader(Plain(), **COLLATES[case]()),
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(batch_size=4),
        dict(batch_size=None),
        dict(batch_size=5, shuffle=True),
        dict(batch_size=3, collate_fn=default_convert),
    ],
)
def test_dtypes_and_structures(remote, kw):
    batches, _ = compare(
        torchfeed.RemoteDataLoader(remote(Typed), **kw),
        lambda: DataLoader(Typed(), **kw),
    )
    assert batches and all(isinstance(b, dict if "collate_fn" not in kw else list) for b in batches)


KEYS = ["img003", ("shard", 2), "img000", "img011", ("shard", 0), "img007", "img007"]


@pytest.mark.parametrize(
    "kw", [dict(batch_size=3), dict(batch_size=None), dict(batch_size=2, drop_last=True)]
)
def test_any_sampler_key(remote, kw):
    batches, _ = compare(
        torchfeed.RemoteDataLoader(remote(Keyed), sampler=KEYS, **kw),
        lambda: DataLoader(Keyed(), sampler=KEYS, **kw),
    )
    assert batches


ERRORS: dict[str, tuple[type, dict[int, str], dict[str, Any]]] = {
    "key": (Typed, {7: "key"}, dict(batch_size=4)),
    "index": (Typed, {12: "index"}, dict(batch_size=5)),
    "file": (Typed, {3: "file"}, dict(batch_size=None)),
    "custom": (Typed, {9: "custom"}, dict(batch_size=4, shuffle=True)),
    "value": (Typed, {0: "value"}, dict(batch_size=2)),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_in_getitem(remote, case):
    cls, bad, kw = ERRORS[case]
    _, error = compare(
        torchfeed.RemoteDataLoader(remote(cls, 23, bad), **kw),
        lambda: DataLoader(cls(23, bad), **kw),
    )
    assert error is not None


def test_error_in_getitems(remote):
    _, error = compare(
        torchfeed.RemoteDataLoader(remote(Batched, 23, 10), batch_size=4),
        lambda: DataLoader(Batched(23, 10), batch_size=4),
    )
    assert isinstance(error, LookupError) and isinstance(error, torchfeed.RemoteError)
    assert error.indices == [8, 9, 10, 11]


def test_error_in_collate(remote):
    _, error = compare(
        torchfeed.RemoteDataLoader(remote(Plain), batch_size=4, collate_fn=failing_collate),
        lambda: DataLoader(Plain(), batch_size=4, collate_fn=failing_collate),
    )
    assert isinstance(error, ArithmeticError)


@pytest.mark.parametrize(
    "kw", [dict(batch_size=4), dict(batch_size=None), dict(batch_size=3, drop_last=True)]
)
def test_iterable_dataset_like_torch_with_two_workers(remote, kw):
    """Each worker iterates its own shard, batches are taken from workers in turn, and the
    workers' generators are seeded as torch seeds its workers: the same batches, bit for bit."""
    batches, _ = compare(
        torchfeed.RemoteDataLoader(remote(Shards), **kw), lambda: DataLoader(Shards(), num_workers=2, **kw)
    )
    assert {int(b[0].reshape(-1, 2)[0, 1]) for b in batches} == {0, 1}, "both workers served"


def test_iterable_dataset_error(remote):
    _, error = compare(
        torchfeed.RemoteDataLoader(remote(Shards, 23, 9), batch_size=2),
        lambda: DataLoader(Shards(23, 9), num_workers=2, batch_size=2),
        map_style=False,
    )
    assert isinstance(error, RuntimeError) and "stream broke at 9" in str(error)


@pytest.mark.slow
def test_worker_init_fn_configures_the_loading_copy_every_epoch(remote):
    """torch's documented example: worker_init_fn splits [start, end) through get_worker_info().dataset."""
    ours = torchfeed.RemoteDataLoader(remote(Span, 3, 20), batch_size=None, worker_init_fn=split_span)
    for _ in range(2):  # the split applies to a fresh copy each pass, as in fresh torch workers
        compare(
            ours, lambda: DataLoader(Span(3, 20), batch_size=None, num_workers=2, worker_init_fn=split_span)
        )
    persistent = torchfeed.RemoteDataLoader(
        remote(Span, 3, 20), batch_size=4, worker_init_fn=split_span, num_workers=2, persistent_workers=True
    )
    theirs = DataLoader(
        Span(3, 20), batch_size=4, worker_init_fn=split_span, num_workers=2, persistent_workers=True
    )
    for _ in range(2):
        compare(persistent, lambda: theirs)


# -- a RemoteDataset inside torch's own DataLoader (code ported step by step) -------------------


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_torch_dataloader_with_worker_processes_over_a_remote_dataset(remote, context):
    """torch's DataLoader(num_workers=2) over a RemoteDataset: each of its worker processes
    (forked, or spawned with the dataset pickled) builds the dataset again on the remote
    workers for itself, and the batches are those of the local dataset."""
    ds = remote(Plain, 37)
    kw = dict(batch_size=4, num_workers=2, multiprocessing_context=context)
    ours = list(DataLoader(ds, **kw))
    assert deep_equal(ours, list(DataLoader(Plain(37), **kw)))
    assert ds[5] is not None  # the parent's own built datasets still work


def test_a_pickled_remote_dataset_carries_no_secret(workers2):
    import pickle

    ds = torchfeed.RemoteDataset(workers2, Plain, 5)
    ds.secret = key = secrets.token_bytes(40)  # as if given explicitly
    state = pickle.loads(pickle.dumps(ds)).__dict__
    assert state["secret"] is None and key not in pickle.dumps(ds)


def test_a_copied_remote_dataset_keeps_its_session_and_secret(workers2):
    import copy

    session = torchfeed.Session(timeout=33)
    ds = torchfeed.RemoteDataset(workers2, Plain, 5, session=session)
    for twin in (copy.copy(ds), copy.deepcopy(ds)):
        assert twin.session is session and twin.timeout == 33 and twin.secret is ds.secret
        assert deep_equal(twin[3], ds[3])
    session.close()
