"""audit=True: loader states record the keys each epoch delivered, and torchfeed.audit.verify
proves from a job's saved states that an epoch delivered every sample once, across ranks and
resumes, or names the samples lost or repeated (a loader bug is simulated by moving the
sampler's position as the bug this audit was made for did)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchfeed
import torchfeed.audit
from helpers import RangeDataset, WorkerShare, elastic_loader, run_in_segments
from torchfeed.loader import sampling
from torchfeed.loader.audit import KeySet

N = 45
BATCH = 4


@pytest.fixture(scope="module")
def rds(workers2):
    return torchfeed.RemoteDataset(workers2, RangeDataset, N)


def loader_of(rds, world: int, rank: int):
    return elastic_loader(rds, BATCH, world, rank, audit=True)


def chain(rds, worlds: list[int], stops: list[int]) -> list[dict]:
    """A job run in segments of ``worlds[k]`` ranks moving in step, each stopping after
    ``stops[k]`` batches (the last one at the end of the epoch) and saving every rank's state;
    rank r of the next segment resumes from old rank r's state (rank 0's when the world grew).
    Returns every state saved."""
    _, saved = run_in_segments(
        lambda world, rank: loader_of(rds, world, rank), worlds, stops, lambda k, r, old: r if r < old else 0
    )
    return [state for segment in saved for state in segment]


def test_one_rank_one_epoch_is_verified(rds):
    loader = torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True, seed=1, audit=True)
    for _ in loader:
        pass
    report = torchfeed.audit.verify([loader.state_dict()], N)
    assert report.ok and report.epoch == 0 and report.segments == 1, str(report)
    assert "all 45 samples delivered exactly once" in str(report)


def test_a_chain_of_resumes_over_changing_worlds_is_verified(rds):
    saved = chain(rds, [2, 1, 3], [2, 2, 0])
    report = torchfeed.audit.verify(saved, N)
    assert report.ok, str(report)
    assert report.segments == 2 + 1 + 3


def test_a_states_record_is_small(rds):
    saved = chain(rds, [2, 1, 3], [2, 2, 0])
    assert max(len(KeySet.from_state(e["keys"], N).bits) for s in saved for e in s["audit"]["entries"]) <= N
    assert all(len(e["keys"]["bits"]) < 64 for s in saved for e in s["audit"]["entries"])


@pytest.mark.parametrize("shift, found", [(BATCH * 2, "missing"), (-BATCH * 2, "duplicates")])
def test_a_resume_that_moves_the_position_wrongly_is_reported_by_index(rds, monkeypatch, shift, found):
    right = sampling.DistributedSampler.position

    def wrong(self, state):  # a loader bug: where a resume continues is off by `shift` samples
        at = right(self, state)
        return at if at in (0, self.num_samples_total) else min(max(at + shift, 0), self.num_samples_total)

    monkeypatch.setattr(sampling.DistributedSampler, "position", wrong)
    report = torchfeed.audit.verify(chain(rds, [2, 2], [2, 0]), N)
    assert not report.ok
    if found == "missing":
        assert len(report.missing) == BATCH * 2 and not report.duplicates
    else:
        assert len(report.duplicates) == BATCH * 2 and not report.missing
        assert set(report.duplicates.values()) == {2}
    assert str(report).startswith("epoch 0:")


def test_a_missing_rank_state_is_named(rds):
    # the world shrank: old rank 1's segment is in its own checkpoint state only
    saved = chain(rds, [2, 1], [2, 0])
    assert torchfeed.audit.verify(saved, N).ok
    without = [s for s in saved if not (s["active"] and s["audit"]["entries"][-1]["rank"] == 1)]
    report = torchfeed.audit.verify(without, N)
    assert not report.ok and any("rank(s) [1]" in p for p in report.problems)


def test_a_batch_left_out_on_an_exception_is_not_in_the_record(rds):
    loader = loader_of(rds, 1, 0)
    it = iter(loader)
    for _ in range(3):
        next(it)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        state = loader.state_dict()
    resumed = loader_of(rds, 1, 0)
    resumed.load_state_dict(state)
    for _ in resumed:
        pass
    report = torchfeed.audit.verify([state, resumed.state_dict()], N)
    assert report.ok, str(report)


def test_an_unfinished_epoch_is_refused_and_an_iterable_dataset_cannot_be_audited(rds, workers2):
    loader = loader_of(rds, 1, 0)
    next(iter(loader))
    with pytest.raises(ValueError, match="finished epoch"):
        torchfeed.audit.verify([loader.state_dict()], N)
    with pytest.raises(ValueError, match="iterable-style"):
        torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(workers2, WorkerShare, 8), 2, audit=True)
    with pytest.raises(ValueError, match="audit=True"):
        torchfeed.audit.verify([torchfeed.RemoteDataLoader(rds, BATCH).state_dict()], N)


def test_gather_without_a_process_group_is_this_ranks_record(rds):
    loader = loader_of(rds, 1, 0)
    for _ in loader:
        pass
    assert torchfeed.audit.verify(torchfeed.audit.gather(loader), N).ok


@pytest.mark.parametrize(
    "change, message",
    [
        ({"size": 1 << 33}, "names 8589934592 keys, for a dataset of 45"),  # 1 GiB of bits if believed
        ({"size": 7}, "does not match"),
        ({"repeats": [[-1, 2]]}, "repeat"),
        ({"bits": "text"}, "not what torchfeed writes"),
        ({"bits": b"not zlib"}, "does not decompress"),
    ],
)
def test_a_crafted_record_is_refused(rds, change, message):
    loader = loader_of(rds, 1, 0)
    for _ in loader:
        pass
    state = loader.state_dict()
    entry = state["audit"]["entries"][-1]
    entry["keys"] = {**entry["keys"], **change}
    with pytest.raises(ValueError, match=message):
        torchfeed.audit.verify([state], N)


@pytest.mark.parametrize("entry", [None, "x", {"epoch": 0}])
def test_a_crafted_entry_is_refused_with_a_value_error(rds, entry):
    with pytest.raises(ValueError, match="audit entry|not one torchfeed writes"):
        torchfeed.audit.verify([{"audit": {"format": "torchfeed.audit/1", "entries": [entry]}}], N)


def test_drop_last_ranks_agree_on_the_end_of_the_epoch(workers2):
    """7 samples, 2 ranks, batches of 2, drop_last: each rank's last state says the epoch ended."""
    ds = torchfeed.RemoteDataset(workers2, RangeDataset, 7)
    loaders: list[torchfeed.RemoteDataLoader[Any]] = [
        torchfeed.RemoteDataLoader(
            ds, 2, sampler=torchfeed.DistributedSampler(ds, 2, r, seed=0, drop_last=True), seed=1, audit=True
        )
        for r in range(2)
    ]
    its = [iter(loader) for loader in loaders]
    for _ in range(2):  # the epoch's batches, without the call that ends it
        for it in its:
            next(it)
    entries = [loader.state_dict()["audit"]["entries"][-1] for loader in loaders]
    assert [(e["upto"], e["complete"]) for e in entries] == [(6, True), (6, True)]
    report = torchfeed.audit.verify([loader.state_dict() for loader in loaders], 7)
    order = torch.randperm(7, generator=torch.Generator().manual_seed(0)).tolist()
    assert report.missing == [order[6]] and not report.duplicates  # the tail drop_last leaves out
