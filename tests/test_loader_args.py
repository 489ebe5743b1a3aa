"""RemoteDataLoader takes, checks and exposes DataLoader's arguments as torch does."""

from __future__ import annotations

import logging
import typing
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, Subset, random_split

import torchfeed
from compat_datasets import Keyed, Plain, Shards
from helpers import deep_equal

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def plain(workers2):
    return torchfeed.RemoteDataset(workers2, Plain, 23)


@pytest.fixture(scope="module")
def shards(workers2):
    return torchfeed.RemoteDataset(workers2, Shards, 23)


def _raises_like_torch(
    error: type[Exception], theirs: Callable[[], object], ours: Callable[[], object]
) -> None:
    """``theirs()`` (torch) and ``ours()`` (torchfeed) both raise ``error``, with the same message."""
    with pytest.raises(error) as torchs:
        theirs()
    with pytest.raises(error) as torchfeeds:
        ours()
    assert str(torchfeeds.value) == str(torchs.value)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_workers=-1),
        dict(num_workers=0, prefetch_factor=2),
        dict(num_workers=2, prefetch_factor=-1),
        dict(persistent_workers=True, num_workers=0),
        dict(multiprocessing_context="fork", num_workers=0),
        dict(multiprocessing_context="teleport", num_workers=2),
        dict(timeout=-1),
        dict(sampler=[0, 1], shuffle=True),
        dict(batch_sampler=[[0]], batch_size=2),
        dict(batch_size=None, drop_last=True),
    ],
)
def test_argument_errors_are_torchs(plain, kw):
    _raises_like_torch(
        ValueError, lambda: DataLoader(Plain(), **kw), lambda: torchfeed.RemoteDataLoader(plain, **kw)
    )


def test_context_of_the_wrong_type_is_a_type_error_like_torchs(plain):
    _raises_like_torch(
        TypeError,
        lambda: DataLoader(Plain(), num_workers=2, multiprocessing_context=5),
        lambda: torchfeed.RemoteDataLoader(plain, num_workers=2, multiprocessing_context=5),
    )


@pytest.mark.parametrize("kw", [dict(shuffle=True), dict(sampler=[0, 1]), dict(batch_sampler=[[0, 1]])])
def test_iterable_dataset_argument_errors_are_torchs(shards, kw):
    _raises_like_torch(
        ValueError, lambda: DataLoader(Shards(), **kw), lambda: torchfeed.RemoteDataLoader(shards, **kw)
    )


@pytest.mark.parametrize(
    "name, value",
    [
        ("batch_size", 4),
        ("sampler", [0]),
        ("batch_sampler", [[0]]),
        ("drop_last", True),
        ("dataset", None),
        ("persistent_workers", True),
    ],
)
def test_assigning_after_construction_raises_like_torch(plain, name, value):
    theirs = DataLoader(Plain())
    ours = torchfeed.RemoteDataLoader(plain)
    with pytest.raises(ValueError) as t:
        setattr(theirs, name, value)
    with pytest.raises(ValueError) as o:
        setattr(ours, name, value)
    assert str(o.value) == str(t.value).replace("DataLoader", "RemoteDataLoader")
    ours.timeout = 5  # the others can be set, as in torch
    ours.multiprocessing_context = "spawn"
    assert ours.multiprocessing_context is not None and ours.timeout == 5


def test_has_every_attribute_of_torchs_dataloader(plain):
    settings: dict[str, Any] = dict(
        batch_size=4,
        num_workers=2,
        prefetch_factor=3,
        persistent_workers=True,
        multiprocessing_context="spawn",
        worker_init_fn=print,
        pin_memory=False,
    )
    theirs = DataLoader(Plain(), **settings)
    ours = torchfeed.RemoteDataLoader(plain, **settings)
    public = [a for a in dir(theirs) if not a.startswith("_")]
    missing = [a for a in public if not hasattr(ours, a)]
    assert not missing
    for name in [
        "batch_size",
        "drop_last",
        "num_workers",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory",
        "pin_memory_device",
        "worker_init_fn",
        "in_order",
        "generator",
    ]:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert type(ours.multiprocessing_context) is type(theirs.multiprocessing_context)
    assert type(ours.sampler) is type(theirs.sampler) and type(ours.batch_sampler) is type(
        theirs.batch_sampler
    )
    assert ours.collate_fn is theirs.collate_fn
    ours.check_worker_number_rationality()  # torch's check, which returns nothing
    assert torchfeed.RemoteDataLoader(plain).num_workers == 2  # omitted: the number of remote workers


def test_generic_like_torch():
    assert typing.get_origin(torchfeed.RemoteDataLoader[torch.Tensor]) is torchfeed.RemoteDataLoader
    assert typing.get_origin(torchfeed.RemoteDataset[int]) is torchfeed.RemoteDataset
    assert issubclass(torchfeed.RemoteDataset, torch.utils.data.Dataset)


def test_positional_arguments_in_torchs_order(plain):
    loader = torchfeed.RemoteDataLoader(plain, 4, False, None, None, 2, None, False, True)
    assert (loader.batch_size, loader.num_workers, loader.drop_last) == (4, 2, True)
    assert deep_equal(list(loader), list(DataLoader(Plain(), 4, False, None, None, 0, None, False, True)))
    with pytest.raises(TypeError, match="6th positional argument .* is num_workers"):
        torchfeed.RemoteDataLoader(plain, 4, False, None, None, lambda b: b)  # type: ignore[arg-type]  # a collate_fn in num_workers' place: refused


def test_ignored_arguments_are_logged_once(plain, caplog):
    from torchfeed.loader import checks as loader_module

    loader_module._logged_once.clear()
    with caplog.at_level(logging.WARNING, logger="torchfeed.loader"):
        for _ in range(3):
            torchfeed.RemoteDataLoader(
                plain,
                num_workers=16,
                pin_memory_device="cuda",
                in_order=False,
                multiprocessing_context="spawn",
            )
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4, messages
    assert any("num_workers=16 has no effect" in m and "2 worker process(es)" in m for m in messages)
    assert any("in_order=False" in m for m in messages)
    # and loading is unaffected
    assert len(list(torchfeed.RemoteDataLoader(plain, batch_size=5, num_workers=16, in_order=False))) == 5


def test_subset_random_split_and_concat(workers2, plain):
    other = torchfeed.RemoteDataset(workers2, Plain, 5)
    local, local_other = Plain(23), Plain(5)
    views = [
        (Subset(plain, [22, 3, 3, 0]), Subset(local, [22, 3, 3, 0])),
        (
            random_split(plain, [0.7, 0.3], generator=torch.Generator().manual_seed(1))[1],
            random_split(local, [0.7, 0.3], generator=torch.Generator().manual_seed(1))[1],
        ),
        (ConcatDataset([plain, other]), ConcatDataset([local, local_other])),
        (ConcatDataset([plain, other, plain]), ConcatDataset([local, local_other, local])),  # one twice
        (plain + Subset(other, [4, 1]), local + Subset(local_other, [4, 1])),
        (
            Subset(ConcatDataset([Subset(plain, range(10, 20)), other]), [0, 14, 9, -1]),
            Subset(ConcatDataset([Subset(local, range(10, 20)), local_other]), [0, 14, 9, -1]),
        ),
    ]
    for ours, theirs in views:
        settings: list[dict[str, Any]] = [
            dict(batch_size=3),
            dict(batch_size=None),
            dict(batch_size=4, shuffle=True),
        ]
        for kw in settings:
            torch.manual_seed(5)
            got = list(torchfeed.RemoteDataLoader(ours, **kw))
            torch.manual_seed(5)
            assert deep_equal(got, list(DataLoader(theirs, **kw)))
            assert len(torchfeed.RemoteDataLoader(ours, **kw)) == len(DataLoader(theirs, **kw))


@pytest.mark.slow
def test_concat_needs_shared_workers(workers2, fresh_workers):
    elsewhere = torchfeed.RemoteDataset(fresh_workers(1).addresses, Plain, 4)
    here = torchfeed.RemoteDataset(workers2, Plain, 4)
    with pytest.raises(ValueError, match="built on different workers"):
        torchfeed.RemoteDataLoader(ConcatDataset([here, elsewhere]))


def test_string_and_tuple_keys_with_per_sample_seeding(workers2):
    ds = torchfeed.RemoteDataset(workers2, Keyed)
    keys = ["img001", ("shard", 3), "img010"]
    got = list(torchfeed.RemoteDataLoader(ds, sampler=keys, batch_size=2, seed=3))
    assert [b.tolist() for b in got] == [[1, 103], [10]]
    err = None
    try:
        list(torchfeed.RemoteDataLoader(ds, sampler=["img001", "nope"], batch_size=2))
    except KeyError as exc:
        err = exc
    assert isinstance(err, torchfeed.RemoteError) and err.indices == ["img001", "nope"]
