"""The trainer's side of reproducible sampling.

* :class:`DistributedSampler` splits one seeded global order among ranks and resumes
  after the number of ranks changed.
* :func:`set_random_seeds`, the seed project's helper, seeds a worker's global generators.

Seeds themselves (:func:`mix_seed`, ``INT63``) and the workers' generator states are in
:mod:`torchfeed.seeding`; the two are importable from here too, as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from ..seeding import INT63, mix_seed, seed_all
from .checks import job_ranks

__all__ = ["INT63", "DistributedSampler", "mix_seed", "set_random_seeds"]


def set_random_seeds(base_seed: int, worker_id: int) -> None:
    """Seed Python's, numpy's and torch's default generators on a worker.

    The seed project's helper: run it once on each worker (for example with
    ``RemoteDataset.run_on_workers(set_random_seeds, base_seed, pass_worker_id=True)``) to
    give each worker a distinct stream derived from ``base_seed`` and ``worker_id``.
    ``RemoteDataLoader`` already seeds every sample exactly, so this is only needed for
    randomness outside of loading.
    """
    seed_all(mix_seed(base_seed, worker_id))


class DistributedSampler(TorchDistributedSampler):
    """Elastic distributed sampler: one seeded global order shared by all ranks.

    It is a ``torch.utils.data.DistributedSampler`` to every framework that checks (Lightning
    keeps it instead of putting its own in, Accelerate and the HF Trainer see a sharded loader),
    with torch's attributes (``num_replicas``, ``rank``, ``epoch``, ``num_samples``,
    ``total_size``); torch's ``__init__`` is not run, so no process group is needed.

    Rank ``r`` of ``W`` takes positions ``start + r, start + r + W, ...`` of the global
    order for the epoch. With ``start=0`` this is exactly torch's ``DistributedSampler``:
    the same permutation for the same ``seed`` and epoch (``randperm`` seeded with
    ``seed + epoch``), the same padding (``drop_last=False`` repeats the epoch's first
    samples so every rank gets the same count, unless ``pad=False``) and the same indices
    per rank. The state records the global position, so a job can resume after the number
    of ranks changed and every remaining sample is still seen exactly once across the job;
    padding always comes from the epoch's order, so a resumed rank pads with the samples
    it would have padded with. ``len()`` is the epoch's count per rank (a resumed pass
    yields fewer, as a resumed torch loader yields fewer batches than its length).

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
        if num_replicas is None or rank is None:
            job_rank, job_world = job_ranks()
            num_replicas = job_world if num_replicas is None else num_replicas
            rank = job_rank if rank is None else rank
        self.dataset = dataset  # type: ignore[assignment]  # torch names a Dataset; a length does here
        self.num_samples_total = dataset if isinstance(dataset, int) else len(dataset)
        self.num_replicas = num_replicas
        self.rank = rank
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
        if self.shuffle:  # as torch's DistributedSampler: the same seed and epoch give the same order
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.num_samples_total, generator=g)
        return torch.arange(self.num_samples_total)

    def _rank_count(self, start: int) -> int:
        remaining = self.num_samples_total - start
        w = self.num_replicas
        if self.drop_last:
            return remaining // w
        if self.pad:
            return math.ceil(remaining / w)
        return len(range(self.rank, remaining, w))

    def __len__(self) -> int:
        return self._rank_count(0)

    # torch's DistributedSampler keeps these as attributes; here they follow the settings
    @property
    def num_samples(self) -> int:
        return self._rank_count(0)

    @num_samples.setter
    def num_samples(self, value: int) -> None:
        raise AttributeError("num_samples follows the dataset, num_replicas and drop_last: set those")

    @property
    def total_size(self) -> int:
        return self._rank_count(0) * self.num_replicas

    @total_size.setter
    def total_size(self, value: int) -> None:
        raise AttributeError("total_size follows the dataset, num_replicas and drop_last: set those")

    def __iter__(self) -> Iterator[int]:
        order = self._global_order()
        remaining = order[self.start :]
        w, count = self.num_replicas, self._rank_count(self.start)
        short = count * w - len(remaining)
        if not self.drop_last and self.pad and short > 0 and len(order):
            # the padding repeats the epoch's order from its beginning (torch's), whatever ``start``
            reps = math.ceil(short / len(order))
            remaining = torch.cat([remaining, order.repeat(reps)[:short]])
        return iter(remaining[self.rank :: w][:count].tolist())

    def state_dict(self, consumed_on_rank: int = 0) -> dict[str, int]:
        """Plain-data state; ``consumed_on_rank`` samples of this pass were already used."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "start": self.start,
            "world_size": self.num_replicas,
            "rank": self.rank,
            "pad": self.pad and not self.drop_last,
            "drop_last": self.drop_last,
            "consumed_on_rank": int(consumed_on_rank),
            "num_samples_total": self.num_samples_total,
        }

    def position(self, state: dict[str, int]) -> int:
        """The global position after ``state``: the ranks of its job move in step, so when the
        saving rank had consumed ``consumed_on_rank`` samples from ``start`` in batches that
        could hold ``capacity``, every rank had consumed as many of its share as that capacity
        holds, and the positions before are all used."""
        total = self.num_samples_total
        start, world, consumed = int(state["start"]), int(state["world_size"]), int(state["consumed_on_rank"])
        if not (0 <= start <= total and world >= 1 and consumed >= 0):
            raise ValueError(
                f"this sampler state is not one a DistributedSampler of {total} samples makes "
                f"(start {start}, world_size {world}, consumed_on_rank {consumed})"
            )
        rank, capacity = state.get("rank"), state.get("capacity")
        if rank is not None and not 0 <= int(rank) < world:
            raise ValueError(f"this sampler state names rank {rank} of a world of {world}")
        if rank is None or capacity is None or state.get("pad", True) or state.get("drop_last", False):
            # padded or cut shares are equal: every rank consumed as many
            return min(start + consumed * world, total)
        share = len(range(start + int(rank), total, world))
        if consumed < share:  # its batches were full so far: every rank filled as many
            capacity = consumed
        # without padding the shares differ by one: each rank consumed what its batches held
        return start + sum(min(int(capacity), len(range(start + r, total, world))) for r in range(world))

    def end(self) -> int:
        """The global position where this epoch ends from ``start`` (``drop_last`` leaves the
        tail that would not give every rank a sample)."""
        if self.drop_last:
            return self.start + self._rank_count(self.start) * self.num_replicas
        return self.num_samples_total

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after ``state``, with this sampler's (possibly different) world size."""
        if state["num_samples_total"] != self.num_samples_total:
            raise ValueError(
                f"the state is for a dataset of {state['num_samples_total']} samples, "
                f"this sampler has {self.num_samples_total}"
            )
        position = self.position(state)
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self.start = position
