"""Every core of the trainer's machine first: autoscale over a LocalPool and another pool.

Both pools start real worker processes on this machine; the second stands for a remote pool
(a Dask or Slurm pool elsewhere): what is tested is the order in which the controller asks
them for workers and drains them.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

import torchfeed
from helpers import FAST_AUTOSCALE
from torchfeed.scaling import LocalPool, Tiers
from torchfeed.util import cpu_count

pytestmark = pytest.mark.timeout(300)


def wait_for(condition, limit: float = 120.0) -> bool:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_local_pool_keeps_a_core_for_the_trainer_by_default():
    assert LocalPool().limit == max(cpu_count() - 1, 1)
    assert LocalPool(keep_for_trainer=0).limit == cpu_count()
    with pytest.raises(ValueError, match="cpu_budget"):
        LocalPool(cpu_budget=0)


def test_tiers_fill_the_cheapest_pool_first_and_name_the_dearest():
    with LocalPool(cpu_budget=2) as near, LocalPool(cpu_budget=8) as far:
        tiers = Tiers([near, far])
        tiers.scale(1)
        assert (near.requested(), far.requested()) == (1, 0)
        tiers.scale(3)
        assert (near.requested(), far.requested()) == (2, 1)
        assert wait_for(lambda: len(tiers.addresses()) == 3)
        assert sorted(tiers.expense(a) for a in tiers.addresses()) == [0, 0, 1]
        tiers.retire([a for a in tiers.addresses() if tiers.expense(a) == 1])
        assert (near.requested(), far.requested()) == (2, 0)


class Slow(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int):
        time.sleep(0.02)
        return i


@pytest.mark.slow
def test_autoscale_grows_same_host_workers_first_and_drains_remote_ones_first(caplog):
    caplog.set_level(logging.INFO, logger="torchfeed.autoscale")
    with LocalPool(cpu_budget=2) as near, LocalPool(cpu_budget=8) as far:
        near.scale(1)
        assert wait_for(lambda: len(near.addresses()) == 1)
        ds = torchfeed.RemoteDataset(near.addresses(), Slow)
        loader = torchfeed.RemoteDataLoader(ds, batch_size=4, shuffle=True)
        asked: list[tuple[int, int]] = []  # (near, far) requests, as the controller made them

        def epoch(per_sample: float) -> list[int]:
            seen: list[int] = []
            for batch in loader:
                seen += batch.tolist()
                asked.append((near.requested(), far.requested()))
                time.sleep(per_sample * len(batch))
            return seen

        with torchfeed.autoscale(loader, [near, far], max_workers=3, **FAST_AUTOSCALE) as scaler:
            deadline = time.monotonic() + 200
            while len(ds.workers) < 3 and time.monotonic() < deadline:  # a hungry trainer: grow
                assert sorted(epoch(0.0)) == list(range(60))
            assert len(ds.workers) == 3, scaler.stats()
            assert sorted(ds.workers) == sorted(near.addresses() + far.addresses())
            assert len(near.addresses()) == 2 and len(far.addresses()) == 1
            # never a remote worker while a core of this machine was left
            assert all(f == 0 or n == 2 for n, f in asked), asked
            while len(ds.workers) > 2 and time.monotonic() < deadline:  # a slow trainer: shrink
                assert sorted(epoch(0.05)) == list(range(60))
            assert wait_for(lambda: far.requested() == 0, 60), scaler.stats()  # the remote one went first
            assert set(ds.workers) <= set(near.addresses()), (ds.workers, near.addresses())
