"""Code that runs on the workers for the loader: fetch samples, seed them, collate."""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
    default_convert,
)

from . import buffers
from .sampling import enter_seeded, mix_seed, seed_all

# seed tags that keep the collate's and a __getitems__ call's streams apart from samples'
_COLLATE_TAG = 0xC011A7E
_BATCH_TAG = 0xBA7C4


def _stack_into_pool(batch, *, collate_fn_map=None):
    """torch's tensor collation, stacking into pooled memory (reused once the batch is sent)."""
    elem = batch[0]
    if (elem.layout == torch.strided and not elem.is_nested and elem.device.type == "cpu"
            and all(t.dtype == elem.dtype and t.shape == elem.shape for t in batch)):
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
    """Worker-side: turn a batch of indices into a collated batch (like torch's fetcher)."""

    manages_rng = True  # the worker must not restore generator states before calling it

    def __init__(self, dataset, collate_fn: Callable, auto_collation: bool):
        self.dataset = dataset
        self.collate_fn = pooled_default_collate if collate_fn is default_collate else collate_fn
        self.auto_collation = auto_collation

    def __call__(self, index, seed: Optional[int] = None):
        """Load and collate ``index``; with ``seed``, every sample runs under its own seed.

        Each sample's ``__getitem__`` sees Python's, numpy's and torch's global generators
        seeded from ``(seed, sample index)``, a custom collate from ``(seed, tag, first
        index)``; the worker's own generator states are restored before any other call
        runs on it. So a sample's randomness does not depend on which worker loads it,
        when, or how often.
        """
        if seed is None:
            return self._fetch(index)
        enter_seeded()  # the worker's own states come back before any other call runs
        if not self.auto_collation:
            seed_all(mix_seed(seed, _index_key(index)))
            return self.collate_fn(self.dataset[index])
        first = _index_key(index[0]) if len(index) else 0
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems:  # one call for the whole batch: one seed for it
            seed_all(mix_seed(seed, _BATCH_TAG, first))
            data = getitems(index)
        else:
            data = []
            for i in index:
                seed_all(mix_seed(seed, _index_key(i)))
                data.append(self.dataset[i])
        if self.collate_fn not in _RANDOM_FREE_COLLATES:
            seed_all(mix_seed(seed, _COLLATE_TAG, first))
        return self.collate_fn(data)

    def _fetch(self, index):
        if self.auto_collation:
            getitems = getattr(self.dataset, "__getitems__", None)
            data = getitems(index) if getitems else [self.dataset[i] for i in index]
        else:
            data = self.dataset[index]
        return self.collate_fn(data)


def _index_key(index) -> int:
    if isinstance(index, int):
        return index
    try:
        return int(index)
    except (TypeError, ValueError):
        return zlib.crc32(repr(index).encode())


