"""Seeds and the global random generators' states: the low layer that data loading runs on.

Worker-side and shared by both ends (no sampler, no loader here):

* :func:`mix_seed` derives well-mixed 64-bit seeds from tuples such as
  (seed, epoch, sample index), so neighbouring samples get unrelated random streams.
* :func:`seed_all` and :func:`seed_like_torch` seed Python's ``random``, numpy's global
  generator and torch's default generator.
* :class:`Stream`, :func:`use`, :func:`enter_seeded` and :func:`restore_outside` share the
  global generators between loader passes on a worker and the code that runs between them:
  every owner gets back the states it left.

The trainer's side (:class:`~torchfeed.loader.sampling.DistributedSampler`) is in sampling.py.
"""

from __future__ import annotations

import random
import threading

import numpy as np
import numpy.random  # noqa: F401 - numpy 2 imports it on first use (~10 ms): a worker pays it at start, not in its first batch
import torch

__all__ = [
    "INT63",
    "PER_SAMPLE",
    "Stream",
    "enter_seeded",
    "extend_seed",
    "global_states",
    "mix_seed",
    "restore_outside",
    "seed_all",
    "seed_like_torch",
    "set_global_states",
    "use",
]

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


_MIX_START = 0x243F6A8885A308D3


def mix_seed(*values: int) -> int:
    """A 64-bit seed that depends on every value (not a plain sum: (1, 2) != (2, 1))."""
    return extend_seed(_MIX_START, *values)


def extend_seed(mixed: int, *values: int) -> int:
    """Mix more values into a seed: ``extend_seed(mix_seed(a), b) == mix_seed(a, b)``, so a
    prefix shared by many seeds is mixed once."""
    h = mixed
    for v in values:
        h = _splitmix64(h ^ (int(v) & _MASK))
    return h


INT63 = (1 << 63) - 1  # torch's seeds (torch.initial_seed()) lie in [0, 2**63), so they can be collated


def seed_all(seed: int) -> None:
    """Seed Python's, numpy's global and torch's default CPU generator from one 64-bit seed.

    Each generator gets its own derived seed, ``mix_seed(seed, k)`` for k = 1, 2, 3 (the
    same words in two Mersenne Twisters would give the very same numbers): Python's with
    64 bits, torch's with 63; numpy's global generator with the low 32 bits of its own,
    through numpy's integer seeding, which takes 32 bits (its array form would keep 64 but
    costs about three times as much, ~60 µs more per sample once caches are cold, as they
    are after a sample that waited on I/O).
    """
    h = mix_seed(seed)  # the shared first round: mix_seed(seed, k) == extend_seed(h, k)
    random.seed(_splitmix64(h ^ 1))
    np.random.seed(_splitmix64(h ^ 2) & 0xFFFFFFFF)
    # the CPU generator only: torch.manual_seed also visits every accelerator backend
    # and costs ~100x more, per sample
    torch.default_generator.manual_seed(_splitmix64(h ^ 3) & INT63)


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


def global_states() -> tuple:
    """Python's, numpy's global and torch's default CPU generator states, together."""
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def set_global_states(states: tuple) -> None:
    """Load states taken by :func:`global_states`."""
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
        self.states = global_states()

    def load(self) -> None:
        if self.states is not None:
            set_global_states(self.states)


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
            _Owner.outside = global_states()
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
        set_global_states(states)
