"""Accelerate in this process (one process, CPU): a prepared RemoteDataLoader's state saved by
``accelerator.save_state`` resumes with the batch the user had in hand when an exception
interrupted its step, and without it after a step that finished; a loader sharded by its
sampler is refused before Accelerate shards it again."""

from __future__ import annotations

import pytest
import torch

import torchfeed
from helpers import RangeDataset, indices
from torchfeed.frameworks import accelerate as tf_accelerate

accelerate = pytest.importorskip("accelerate")
N = 22


@pytest.fixture(scope="module")
def rds(workers2):
    return torchfeed.RemoteDataset(workers2, RangeDataset, N)


def keys(batch) -> list[int]:
    return batch[1].tolist()


def prepared(rds):
    loader = torchfeed.RemoteDataLoader(rds, 4, shuffle=True, seed=1)
    return tf_accelerate.prepare(accelerate.Accelerator(cpu=True), loader)


def interrupted_at(rds, tmp_path, stop: int, save_in_except: bool = True) -> list[list[int]]:
    accelerator = accelerate.Accelerator(cpu=True)
    loader = tf_accelerate.prepare(accelerator, torchfeed.RemoteDataLoader(rds, 4, shuffle=True, seed=1))
    seen = []
    try:
        for step, batch in enumerate(loader):
            seen.append(keys(batch))
            if step == stop:
                if not save_in_except:
                    accelerator.save_state(tmp_path)  # the step finished: a checkpoint after it
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        if save_in_except:
            accelerator.save_state(tmp_path)
    return seen


def resumed(rds, tmp_path) -> list[list[int]]:
    accelerator = accelerate.Accelerator(cpu=True)
    loader = tf_accelerate.prepare(accelerator, torchfeed.RemoteDataLoader(rds, 4, shuffle=True, seed=1))
    accelerator.load_state(tmp_path)
    return [keys(b) for b in loader]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [0, 2, 5])  # the first, a middle and the last of 6 batches
def test_a_save_while_an_exception_unwinds_resumes_with_the_batch_in_hand(rds, tmp_path, stop):
    seen = interrupted_at(rds, tmp_path, stop)
    rest = resumed(rds, tmp_path)
    assert rest[0] == seen[stop]
    assert sorted(k for b in seen[:stop] + rest for k in b) == list(range(N))


@pytest.mark.slow
def test_a_save_after_a_finished_step_resumes_after_it(rds, tmp_path):
    seen = interrupted_at(rds, tmp_path, 2, save_in_except=False)
    rest = resumed(rds, tmp_path)
    assert sorted(k for b in seen + rest for k in b) == list(range(N))


def test_a_loader_sharded_by_its_sampler_is_refused_before_accelerate_shards_it_again(rds):
    sampler: torch.utils.data.Sampler[int]
    for sampler in (
        torchfeed.DistributedSampler(rds, num_replicas=2, rank=0),
        torch.utils.data.DistributedSampler(indices(N), num_replicas=2, rank=0),
    ):
        loader = torchfeed.RemoteDataLoader(rds, 4, sampler=sampler)
        with pytest.raises(ValueError, match="drop the sampler"):
            tf_accelerate.check_unsharded(loader, processes=2)
        tf_accelerate.check_unsharded(loader, processes=1)  # nothing shards it again
    tf_accelerate.check_unsharded(torchfeed.RemoteDataLoader(rds, 4, shuffle=True), processes=2)
