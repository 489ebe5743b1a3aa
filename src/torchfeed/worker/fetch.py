"""Code that runs on the workers for the loader: fetch samples (any key), seed them, collate."""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable

import torch
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
    default_convert,
)

from .. import seeding
from ..protocol import buffers
from ..seeding import extend_seed, mix_seed, seed_all
from . import counters as workerstats
from .context import WorkerSetup, worker_context

# seed tags that keep the collate's and a __getitems__ call's streams apart from samples'
_COLLATE_TAG = 0xC011A7E
_BATCH_TAG = 0xBA7C4


def _stack_into_pool(batch, *, collate_fn_map=None):
    """torch's tensor collation, stacking into pooled memory (reused once the batch is sent)."""
    elem = batch[0]
    if (
        elem.layout == torch.strided
        and not elem.is_nested
        and elem.device.type == "cpu"
        and all(
            isinstance(t, torch.Tensor)
            and t.dtype == elem.dtype
            and t.shape == elem.shape
            and not t.requires_grad  # stack(out=...) is not differentiable: torch's own stack then
            for t in batch
        )
    ):
        out = buffers.empty_tensor((len(batch), *elem.shape), elem.dtype)
        return torch.stack(batch, 0, out=out)
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_POOLED_COLLATE_MAP = {**default_collate_fn_map, torch.Tensor: _stack_into_pool}


def pooled_default_collate(batch):
    """Same result as ``default_collate``; large stacked tensors reuse worker memory."""
    return collate(batch, collate_fn_map=_POOLED_COLLATE_MAP)


# torch's collates draw no random numbers: no need to seed before them
_RANDOM_FREE_COLLATES = (pooled_default_collate, default_collate, default_convert)


class Fetcher:
    """Worker-side: turn a batch of indices into a collated batch (like torch's fetcher).

    Indices are whatever the sampler yields (ints, strings, tuples...). ``worker_init_fn``
    and ``persistent`` are the loader's; see :class:`torchfeed.worker.context.WorkerSetup`.
    ``reply_limits`` (set by the loader) bounds the size of the replies the trainer accepts.
    """

    manages_rng = True  # the worker must not restore generator states before calling it

    def __init__(
        self,
        dataset,
        collate_fn: Callable,
        auto_collation: bool,
        worker_init_fn: Callable | None = None,
        persistent: bool = False,
        reply_limits=None,
    ):
        self.setup = WorkerSetup(dataset, worker_init_fn, persistent)
        self.collate_fn = pooled_default_collate if collate_fn is default_collate else collate_fn
        self.auto_collation = auto_collation
        self.reply_limits = reply_limits

    @property
    def dataset(self):
        return self.setup.dataset

    def __call__(self, index, seed: int | None = None, context: tuple | None = None):
        """Load and collate ``index``.

        ``context`` is ``(pass id, worker id, number of workers, base seed)``: the first call
        of a pass sets the pass up (worker context, torch-like seeding, ``worker_init_fn``).
        With ``seed``, every sample runs under its own seed: each sample's ``__getitem__``
        sees Python's, numpy's and torch's global generators seeded from ``(seed, sample
        index)``, a custom collate from ``(seed, tag, first index)``; the worker's own
        generator states are restored before any other call runs on it. So a sample's
        randomness does not depend on which worker loads it, when, or how often. Without
        ``seed`` samples draw from the pass's stream, seeded as torch seeds a worker.
        """
        if context is None:
            data = self._samples(self.setup.dataset, index, seed)
        else:
            current = self.setup.enter(*context)
            with worker_context(current.info):
                if seed is None:
                    seeding.use(current.stream)
                data = self._samples(current.dataset, index, seed)
        # Outside the worker context: torch's collate would otherwise put every batch in
        # shared memory, which only its own worker processes need.
        if seed is not None and self.collate_fn not in _RANDOM_FREE_COLLATES:
            first = index_key(index[0]) if self.auto_collation and len(index) else index_key(index)
            seed_all(mix_seed(seed, _COLLATE_TAG, first))
        batch = self.collate_fn(data)
        workerstats.served.add(len(index) if self.auto_collation else 1)  # [stats hook] the worker's metrics
        return batch

    def _samples(self, dataset, index, seed: int | None):
        """The samples of ``index`` (a list of them with auto-collation)."""
        if not self.auto_collation:
            if seed is not None:
                seeding.enter_seeded()  # the worker's own states come back before any other call runs
                seed_all(mix_seed(seed, index_key(index)))
            return dataset[index]
        loading = getattr(dataset, "torchfeed_batch", None)
        if loading is None:
            return self._load_batch(dataset, index, seed)
        with loading(index):  # a cached dataset: asks its peers before seeding, tells owners after
            return self._load_batch(dataset, index, seed)

    def _load_batch(self, dataset, index, seed: int | None) -> list:
        """The samples of a batch's keys, each under its own seed when ``seed`` is set."""
        getitems = getattr(dataset, "__getitems__", None)
        if seed is None:
            return getitems(index) if getitems else [dataset[i] for i in index]
        seeding.enter_seeded()
        if getitems:  # one call for the whole batch: one seed for it
            seed_all(mix_seed(seed, _BATCH_TAG, index_key(index[0]) if len(index) else 0))
            return getitems(index)
        data = []
        prefix = mix_seed(seed)  # mixed once per batch: each sample's seed is mix_seed(seed, key)
        for i in index:
            seed_all(extend_seed(prefix, index_key(i)))
            data.append(dataset[i])
        return data


class Parts:
    """Worker side of a ConcatDataset of several RemoteDatasets: keys are ``(part, index)``."""

    def __init__(self, parts):
        self.parts = list(parts)

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __getitem__(self, key):
        part, index = key
        return self.parts[part][index]


def index_key(index) -> int:
    """A stable 64-bit number for a sample key (ints as they are; strings, tuples... hashed)."""
    try:
        return operator.index(index)
    except TypeError:
        digest = hashlib.blake2b(repr(index).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")
