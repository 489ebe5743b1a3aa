"""Seeding and sampling that make data loading reproducible.

* :func:`mix_seed` derives well-mixed 64-bit seeds from tuples such as
  (seed, epoch, sample index), so neighbouring samples get unrelated random streams.
* :func:`seeded` runs code with Python's ``random``, numpy's global generator and
  torch's default generator seeded, and restores their previous states afterwards.
  Workers run each sample's ``__getitem__`` under it: results do not depend on which
  worker ran a sample, in which order, or how often it was retried.
* :class:`DistributedSampler` splits one seeded global order among ranks and resumes
  after the number of ranks changed.
"""

from __future__ import annotations

import math
import os
import random
import threading
from collections.abc import Iterator, Sized

import numpy as np
import torch
from torch.utils.data import Sampler

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mix_seed(*values: int) -> int:
    """A 64-bit seed that depends on every value (not a plain sum: (1, 2) != (2, 1))."""
    h = 0x243F6A8885A308D3
    for v in values:
        h = _splitmix64(h ^ (int(v) & _MASK))
    return h


INT63 = (1 << 63) - 1  # torch's seeds (torch.initial_seed()) lie in [0, 2**63), so they can be collated


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's global and torch's default CPU generator from one 64-bit seed."""
    # One derived seed per generator: Python's and numpy's Mersenne Twisters seeded with
    # the same words would produce the very same numbers.
    random.seed(mix_seed(seed, 1))
    np_seed = mix_seed(seed, 2)
    np.random.seed([np_seed & 0xFFFFFFFF, np_seed >> 32])
    # the CPU generator only: torch.manual_seed also visits every accelerator backend
    # and costs ~100x more, per sample
    torch.default_generator.manual_seed(mix_seed(seed, 3) & INT63)


def seed_like_torch(base_seed: int, worker_id: int) -> int:
    """Seed the global generators as torch's DataLoader seeds worker ``worker_id``; return the seed.

    Python's and torch's generators get ``base_seed + worker_id``; numpy's global generator
    gets the state torch derives from (base_seed, worker_id) where this torch has that
    function, else a seed mixed from both.
    """
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    derive = getattr(
        getattr(getattr(torch.utils.data, "_utils", None), "worker", None), "_generate_state", None
    )
    if derive is not None:
        np.random.seed(derive(base_seed, worker_id))
    else:
        mixed = mix_seed(base_seed, worker_id)
        np.random.seed([mixed & 0xFFFFFFFF, mixed >> 32])
    return seed


def _global_states() -> tuple:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _set_global_states(states: tuple) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


class Stream:
    """Global generator states that belong to one loader pass on a worker (torch-like seeding).

    Other code may run on the worker between two batches of the pass: the states are
    stashed then, and loaded again before the next batch (see :func:`use`).
    """

    def __init__(self):
        self.states: tuple | None = None

    def stash(self) -> None:
        self.states = _global_states()

    def load(self) -> None:
        if self.states is not None:
            _set_global_states(self.states)


class _PerSample(Stream):
    """Per-sample seeding: every sample reseeds, nothing to keep between batches."""

    def stash(self) -> None:
        pass


PER_SAMPLE = _PerSample()


class _Owner:
    """Who the global generators' states belong to right now.

    ``None`` means code outside of loading (the states it left are ``outside``). Saving
    and restoring numpy's state costs ~0.15 ms, far more than loading a tiny sample, so
    a change of owner is done lazily: consecutive batches of the same owner pay nothing.
    """

    current: Stream | None = None
    outside: tuple | None = None
    lock = threading.Lock()


def use(stream: Stream) -> bool:
    """Give the global generators to ``stream``; True when it did not hold them already.

    The previous owner's states are kept (the outside code's, or another pass's).
    """
    with _Owner.lock:
        previous = _Owner.current
        if previous is stream:
            return False
        if previous is None:
            _Owner.outside = _global_states()
        else:
            previous.stash()
        _Owner.current = stream
        stream.load()  # its own states, if it held the generators before
    return True


def enter_seeded() -> None:
    """Per-sample seeded loading begins: remember the outside states unless already remembered."""
    use(PER_SAMPLE)


def restore_outside() -> None:
    """Give code other than loading the generator states it left behind."""
    if _Owner.current is None:
        return
    with _Owner.lock:
        previous, _Owner.current = _Owner.current, None
        states, _Owner.outside = _Owner.outside, None
        if previous is not None:
            previous.stash()
    if states is not None:
        _set_global_states(states)


def set_random_seeds(base_seed: int, worker_id: int) -> None:
    """Seed Python's, numpy's and torch's default generators on a worker.

    The seed project's helper: run it once on each worker (for example with
    ``RemoteDataset.run_on_workers(set_random_seeds, base_seed, pass_worker_id=True)``) to
    give each worker a distinct stream derived from ``base_seed`` and ``worker_id``.
    ``RemoteDataLoader`` already seeds every sample exactly, so this is only needed for
    randomness outside of loading.
    """
    seed_all(mix_seed(base_seed, worker_id))


def _default_replicas() -> tuple:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


class DistributedSampler(Sampler[int]):
    """Elastic distributed sampler: one seeded global order shared by all ranks.

    Rank ``r`` of ``W`` takes positions ``start + r, start + r + W, ...`` of the global
    order for the epoch. The state records the global position, so a job can resume
    after the number of ranks changed and every remaining sample is still seen exactly
    once across the job (with ``drop_last=False`` the last step is padded by wrapping
    around, as torch's sampler does, unless ``pad=False``).

    Parameters
    ----------
    dataset : Sized or int
        The dataset (or its length).
    num_replicas, rank : int, optional
        World size and rank; default from torch.distributed or ``WORLD_SIZE``/``RANK``.
    shuffle : bool
        Shuffle the global order each epoch from ``(seed, epoch)``.
    seed : int
        Must be the same on every rank.
    drop_last : bool
        Drop the tail so every rank gets the same number of samples.
    start : int
        Global position to start from (like torchelastic's ElasticDistributedSampler).
    pad : bool
        With ``drop_last=False``, repeat samples so all ranks have equal length (torch's
        behaviour; needed by DDP). ``pad=False`` gives exactly-once at the price of ranks
        differing by one sample.
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        start: int = 0,
        pad: bool = True,
    ):
        default_w, default_r = _default_replicas()
        self.num_samples_total = dataset if isinstance(dataset, int) else len(dataset)
        self.num_replicas = default_w if num_replicas is None else num_replicas
        self.rank = default_r if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is not in [0, {self.num_replicas})")
        if not 0 <= start <= self.num_samples_total:
            raise ValueError(f"start {start} is outside the dataset (length {self.num_samples_total})")
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        self.start = start

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (changes the order); a new epoch starts from position 0."""
        if epoch != self.epoch:
            self.start = 0
        self.epoch = epoch

    def _global_order(self) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(mix_seed(self.seed, self.epoch) & ((1 << 63) - 1))
            return torch.randperm(self.num_samples_total, generator=g)
        return torch.arange(self.num_samples_total)

    def _rank_count(self) -> int:
        remaining = self.num_samples_total - self.start
        w = self.num_replicas
        if self.drop_last:
            return remaining // w
        if self.pad:
            return math.ceil(remaining / w)
        return len(range(self.rank, remaining, w))

    def __len__(self) -> int:
        return self._rank_count()

    def __iter__(self) -> Iterator[int]:
        remaining = self._global_order()[self.start :]
        w, count = self.num_replicas, self._rank_count()
        if not self.drop_last and self.pad and len(remaining) and len(remaining) % w:
            reps = math.ceil(count * w / len(remaining))
            remaining = remaining.repeat(reps)[: count * w]
        return iter(remaining[self.rank :: w][:count].tolist())

    def state_dict(self, consumed_on_rank: int = 0) -> dict[str, int]:
        """Plain-data state; ``consumed_on_rank`` samples of this pass were already used."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "start": self.start,
            "world_size": self.num_replicas,
            "consumed_on_rank": int(consumed_on_rank),
            "num_samples_total": self.num_samples_total,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after ``state``, with this sampler's (possibly different) world size."""
        if state["num_samples_total"] != self.num_samples_total:
            raise ValueError(
                f"the state is for a dataset of {state['num_samples_total']} samples, "
                f"this sampler has {self.num_samples_total}"
            )
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        consumed = state["start"] + state["consumed_on_rank"] * state["world_size"]
        self.start = min(consumed, self.num_samples_total)
