"""Worker faults in an iterable-style pass, handled as in a map-style one (loader/faults.py): the
pass follows the dataset's membership (a worker that comes back, or joins through the address
file, takes the streams waiting for one) and stops a stream that kills the workers it runs on."""

from __future__ import annotations

import os

import pytest

import torchfeed
from helpers import PROMPT, batches_of, deep_equal, torch_batches, wait_for
from stream_datasets import CrashesAt, StatefulCounting

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def same_as_torch_despite(ds, event) -> None:
    """One pass of ``ds`` (StatefulCounting(40): 2 streams, batches of 2) with ``event()`` run once 4
    batches arrived: the batches are torch's all the same."""
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2, num_workers=2, prefetch_factor=1, timeout=120)
    ours = batches_of(loader, at=4, event=event)
    assert deep_equal(ours, torch_batches(StatefulCounting(40), batch_size=2, num_workers=2))


def test_a_pass_whose_only_worker_died_goes_on_when_it_comes_back(fresh_workers):
    w = fresh_workers(1)

    def kill_and_restart():
        w.kill(0)
        w.restart(0)  # the same address: the dataset's retries find it again

    same_as_torch_despite(torchfeed.RemoteDataset(w.addresses, StatefulCounting, 40, 0.01), kill_and_restart)


def test_a_worker_joining_through_the_address_file_takes_the_streams_left_without_one(
    fresh_workers, tmp_path
):
    first, second = fresh_workers(1), fresh_workers(1)
    path = tmp_path / "workers"
    path.write_text(first.addresses[0] + "\n")

    def replace_the_worker():  # as a scheduler would: the lost one is gone, a new one listed
        first.kill(0)
        path.write_text(second.addresses[0] + "\n")

    ds = torchfeed.RemoteDataset.from_file(str(path), StatefulCounting, 40, 0.01)
    same_as_torch_despite(ds, replace_the_worker)
    assert ds.workers == second.addresses


def test_a_stream_that_kills_its_workers_is_poison(fresh_workers):
    w = fresh_workers(3)
    # stream 1 of 2 holds the odd numbers: 13 is its 7th item, in its batch 3 (batches of 2)
    ds = torchfeed.RemoteDataset(w.addresses, CrashesAt, 40, 13)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2, num_workers=2, max_retries=1, timeout=120)
    got = []
    with pytest.raises(
        torchfeed.PoisonSampleError,
        match=r"batch \d of stream 1 \(an iterable-style dataset\) killed 2 worker processes",
    ):
        for batch in loader:
            got.append(batch)
    assert [int(i) for b in got for i in b[:, 0]][:6] == [0, 2, 1, 3, 4, 6]  # what came before
    # one death per retry: the third worker was never sent the stream, and still serves
    assert wait_for(lambda: sum(p.poll() is not None for p in w.processes) == 2, PROMPT)
    alive = [w.addresses[i] for i, p in enumerate(w.processes) if p.poll() is None]
    assert list(torchfeed.RemoteDataset(alive, StatefulCounting, 4).run_on_workers(os.getpid)) == alive
