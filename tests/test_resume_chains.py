"""Chains of resumes within an epoch deliver every sample exactly once, with the draws of the
uninterrupted run: random world sizes and stop points (hypothesis), ranks moving in step as
DDP moves them, each resumed rank loading the state of any rank of the job before."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchfeed
from helpers import RandomAugmentDataset, elastic_loader, indices, run_in_segments

N = 45
BATCH = 4


@pytest.fixture(scope="module")
def rds(workers2):
    return torchfeed.RemoteDataset(workers2, RandomAugmentDataset, N)


def rows(batch) -> list[tuple]:
    return [tuple(round(v, 9) for v in row) for row in batch.tolist()]


def uninterrupted(rds) -> dict[int, tuple]:
    """Every sample of epoch 0 with its draws, from one rank reading the whole epoch."""
    got = [r for b in elastic_loader(rds, BATCH, 1, 0) for r in rows(b)]
    assert sorted(int(r[0]) for r in got) == list(range(N))
    return {int(r[0]): r for r in got}


def run_chain(rds, worlds: list[int], stops: list[int], picks: list[int]) -> list[tuple]:
    """Segments of a job: segment k runs ``worlds[k]`` ranks in step for ``stops[k]`` batches
    (the last one to the end), then every rank's state is saved; the next segment's rank r
    loads the state of old rank ``picks[...] % old world``. Returns every row delivered."""
    delivered, _ = run_in_segments(
        lambda world, rank: elastic_loader(rds, BATCH, world, rank),
        worlds,
        stops,
        lambda k, r, old: picks[(k + r) % len(picks)] % old,
    )
    return [row for b in delivered for row in rows(b)]


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    worlds=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    stops=st.lists(st.integers(1, 3), min_size=4, max_size=4),
    picks=st.lists(st.integers(0, 3), min_size=4, max_size=4),
)
def test_any_chain_of_resumes_delivers_each_sample_once_with_its_draws(rds, worlds, stops, picks):
    expected = uninterrupted(rds)
    delivered = run_chain(rds, worlds, stops, picks)
    keys = [int(r[0]) for r in delivered]
    assert sorted(keys) == list(range(N)), (
        f"missing {set(range(N)) - set(keys)}, repeated {len(keys) - len(set(keys))}"
    )
    assert all(expected[int(r[0])] == r for r in delivered)


def test_two_resumes_on_one_rank_lose_nothing(rds):
    """The reported chain: 2 batches, save, resume, 2 more, save, resume, to the end."""
    delivered = run_chain(rds, [1, 1, 1], [2, 2, 0], [0])
    assert sorted(int(r[0]) for r in delivered) == list(range(N))


def test_the_sampler_state_after_a_resume_counts_only_what_followed(rds):
    loader = elastic_loader(rds, BATCH, 1, 0)
    it = iter(loader)
    for _ in range(4):
        next(it)
    first = loader.state_dict()
    resumed = elastic_loader(rds, BATCH, 1, 0)
    resumed.load_state_dict(first)
    it = iter(resumed)
    for _ in range(2):
        next(it)
    state = resumed.state_dict()
    assert state["samples"] == 24 and state["batches"] == 6
    assert state["sampler"]["start"] == 16 and state["sampler"]["consumed_on_rank"] == 8


@pytest.mark.parametrize("sampler", [False, True])
def test_a_state_taken_while_an_exception_unwinds_leaves_out_the_batch_in_hand(rds, sampler):
    """A checkpoint on Ctrl-C inside the training step: the batch handed out was not trained on,
    so the resumed loader yields it first; a checkpoint on the normal path counts it."""

    def make():
        if sampler:
            return elastic_loader(rds, BATCH, 1, 0)
        return torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True, seed=3)

    loader = make()
    it = iter(loader)
    seen = [rows(next(it)) for _ in range(3)]
    normal = loader.state_dict()
    try:
        raise KeyboardInterrupt  # the training step of the third batch is interrupted
    except KeyboardInterrupt:
        on_exception = loader.state_dict()
    assert normal["batches"] == 3 and on_exception["batches"] == 2
    resumed = make()
    resumed.load_state_dict(on_exception)
    rest = [rows(b) for b in resumed]
    assert rest[0] == seen[2]
    assert sorted(int(r[0]) for b in seen[:2] + rest for r in b) == list(range(N))
    # once the consumer came back for the next batch, the third one counts as trained
    next(it)
    try:
        raise RuntimeError("a later step failed")
    except RuntimeError:
        assert loader.state_dict()["batches"] == 3


def test_a_save_in_a_signal_handler_leaves_out_the_batch_in_hand_when_it_says_so(rds):
    """A handler runs anywhere, often inside the step: it passes leave_out=1. The same save
    function called on the normal path (after a step) counts the batch."""
    import signal

    loader = torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True, seed=3)
    it = iter(loader)
    next(it)
    next(it)
    taken: list[dict] = []

    def save(*_):
        taken.append(loader.state_dict())

    previous = signal.signal(signal.SIGUSR1, lambda *_: taken.append(loader.state_dict(leave_out=1)))
    try:
        signal.raise_signal(signal.SIGUSR1)
        signal.signal(signal.SIGUSR2, save)
        save()  # a periodic checkpoint through the function that is also a handler
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    assert [t["batches"] for t in taken] == [1, 2]
    with pytest.raises(ValueError, match="leave_out"):
        loader.state_dict(leave_out=3)


def test_an_iterable_state_taken_while_an_exception_unwinds_replays_the_batch_in_hand(workers2):
    from helpers import WorkerShare

    ds = torchfeed.RemoteDataset(workers2, WorkerShare, 20)
    loader = torchfeed.RemoteDataLoader(ds, 2, num_workers=2)
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        state = loader.state_dict()
    resumed = torchfeed.RemoteDataLoader(ds, 2, num_workers=2)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert rest[0] == seen[2]
    everything = torchfeed.RemoteDataLoader(ds, 2, num_workers=2)
    assert seen[:2] + rest == [b.tolist() for b in everything]


def test_a_torchfeed_sampler_is_a_torch_distributed_sampler(rds):
    sampler = torchfeed.DistributedSampler(rds, num_replicas=2, rank=1, seed=0)
    theirs: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
        indices(N), num_replicas=2, rank=1, seed=0
    )
    assert isinstance(sampler, torch.utils.data.DistributedSampler)
    assert (sampler.num_samples, sampler.total_size) == (theirs.num_samples, theirs.total_size)
    assert list(sampler) == list(theirs)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"start": -500_000_000}, "not one a DistributedSampler"),
        ({"world_size": -1}, "not one a DistributedSampler"),
        ({"rank": 7}, "names rank 7"),
    ],
)
def test_a_crafted_sampler_state_is_refused(rds, change, message):
    loader = elastic_loader(rds, BATCH, 2, 0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    state["sampler"] = {**state["sampler"], **change}
    resumed = elastic_loader(rds, BATCH, 2, 0)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match=message):
        next(iter(resumed))


@pytest.mark.parametrize("name, value", [("batches", 2**64), ("batches", -1), ("samples", "3")])
def test_a_crafted_count_is_refused(rds, name, value):
    loader = elastic_loader(rds, BATCH, 1, 0)
    it = iter(loader)
    next(it)
    state = {**loader.state_dict(), name: value}
    with pytest.raises(ValueError, match=name):
        elastic_loader(rds, BATCH, 1, 0).load_state_dict(state)


def test_a_format_2_state_taken_after_a_resume_is_refused_and_a_first_pass_one_resumes(rds):
    loader = elastic_loader(rds, BATCH, 1, 0)
    it = iter(loader)
    first = [int(r[0]) for _ in range(2) for r in rows(next(it))]
    state = loader.state_dict()
    old = {
        **state,
        "format": "torchfeed.RemoteDataLoader/2",
        "sampler": {**state["sampler"], "consumed_on_rank": 0},
    }
    resumed = elastic_loader(rds, BATCH, 1, 0)
    resumed.load_state_dict(old)
    assert sorted(first + [int(r[0]) for b in resumed for r in rows(b)]) == list(range(N))
    after_resume = {**old, "sampler": {**old["sampler"], "start": 8}, "samples": 16}
    with pytest.raises(ValueError, match="counted the resumed pass's samples twice"):
        elastic_loader(rds, BATCH, 1, 0).load_state_dict(after_resume)


def torch_sharded(rds, world: int, rank: int):
    sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
        indices(N), num_replicas=world, rank=rank, seed=2
    )
    return torchfeed.RemoteDataLoader(rds, BATCH, sampler=sampler, seed=5)


def shuffled(rds, world: int, rank: int):
    return torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True, seed=5)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(stops=st.lists(st.integers(1, 3), min_size=1, max_size=4), sharded=st.booleans())
def test_any_chain_of_checkpoints_without_torchfeeds_sampler_is_exact(rds, stops, sharded):
    """A fixed world (torch's DistributedSampler, 2 ranks; or shuffle=True on one rank): any
    number of checkpoints in one epoch, each resumed in new loaders, gives the uninterrupted
    epoch's batches and draws, in order."""
    make, world = (torch_sharded, 2) if sharded else (shuffled, 1)
    whole = [[rows(b) for b in make(rds, world, r)] for r in range(world)]
    got: list[list] = [[] for _ in range(world)]
    states = None
    for stop in [*stops, None]:
        loaders = [make(rds, world, r) for r in range(world)]
        for r, loader in enumerate(loaders):
            if states is not None:
                loader.load_state_dict(states[r])
        its = [iter(loader) for loader in loaders]
        step, ended = 0, False
        while stop is None or step < stop:
            batches = [next(it, None) for it in its]
            if all(b is None for b in batches):
                ended = True  # the epoch ended before this checkpoint: the chain ends with it
                break
            for r, b in enumerate(batches):
                if b is not None:
                    got[r].append(rows(b))
            step += 1
        if ended:
            break
        states = [loader.state_dict() for loader in loaders]
    assert got == whole


@pytest.mark.parametrize(
    "change",
    [{"streams": 10**7}, {"turn": 5}, {"slots": "x"}],
)
def test_a_crafted_iterable_state_is_refused_at_once(workers2, change):
    from helpers import WorkerShare

    ds = torchfeed.RemoteDataset(workers2, WorkerShare, 20)
    loader = torchfeed.RemoteDataLoader(ds, 2, num_workers=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    state["streams"] = {**state["streams"], **change}
    resumed = torchfeed.RemoteDataLoader(ds, 2, num_workers=2)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="iterable-style state"):
        next(iter(resumed))


def test_a_state_further_into_the_epoch_than_the_sampler_goes_is_refused(rds):
    loader = torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True, seed=5)
    it = iter(loader)
    next(it)
    state = {**loader.state_dict(), "batches": 2**62}
    resumed = torchfeed.RemoteDataLoader(rds, BATCH, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="batches into its epoch"):
        next(iter(resumed))


def test_a_state_taken_after_a_load_and_before_the_resume_is_the_loaded_one(rds):
    loader = elastic_loader(rds, BATCH, 1, 0)
    it = iter(loader)
    seen = [rows(next(it)) for _ in range(3)]
    state = loader.state_dict()
    again = elastic_loader(rds, BATCH, 1, 0)
    again.load_state_dict(state)
    iter(again)  # an iterator made, not read: a job stopped before its first step
    later = elastic_loader(rds, BATCH, 1, 0)
    later.load_state_dict(again.state_dict())
    rest = [rows(b) for b in later]
    assert sorted(int(r[0]) for b in seen + rest for r in b) == list(range(N))
