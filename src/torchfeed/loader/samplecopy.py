"""The two copies a cached sample goes through (:mod:`torchfeed.loader.cache`).

* :func:`kept_copy`, once, when the sample is decoded: what the worker's cache keeps, its
  arrays and tensors copied into the worker's :mod:`~torchfeed.worker.arena` (memory in
  huge pages). The decoded sample itself then goes to ``then``, which may change it.
* :func:`fresh`, at every later access: a copy of the kept sample for ``then``, so what
  ``then`` does in place never reaches the cache (read-only arrays are copied too:
  ``torch.from_numpy`` of one is a writable tensor over its memory).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from ..worker.arena import arena

_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None))
_DEPTH = 32  # containers nested deeper are deep-copied (fresh) or kept as they are (kept_copy)


class _NotPlain(Exception):
    """The sample holds something other than arrays, tensors, lists, tuples, dicts and scalars."""


def kept_copy(sample: Any) -> Any:
    """A copy of ``sample`` whose arrays and tensors lie in the worker's arena; ``sample``
    itself where it holds anything else (an image object, a custom class): kept as it is,
    every access of it then goes through :func:`fresh`."""
    try:
        return _copy_into_arena(sample, 0)
    except _NotPlain:
        return sample


def _copy_into_arena(sample: Any, depth: int) -> Any:
    kind = type(sample)
    if kind in _IMMUTABLE or (isinstance(sample, np.generic) and not sample.dtype.hasobject):
        return sample
    if kind is np.ndarray and not sample.dtype.hasobject:
        out = arena.take(sample.nbytes).view(sample.dtype).reshape(sample.shape)
        np.copyto(out, sample)
        out.flags.writeable = sample.flags.writeable
        return out
    if (
        kind is torch.Tensor
        and sample.layout == torch.strided
        and sample.device.type == "cpu"
        and not sample.requires_grad
        and not sample.is_quantized
    ):
        nbytes = sample.numel() * sample.element_size()
        out = torch.from_numpy(arena.take(nbytes)).view(sample.dtype).view(sample.shape)
        return out.copy_(sample)
    if depth < _DEPTH:
        if kind in (list, tuple):
            return kind(_copy_into_arena(v, depth + 1) for v in sample)
        if kind is dict:
            return {k: _copy_into_arena(v, depth + 1) for k, v in sample.items()}
    raise _NotPlain


def fresh(sample: Any, depth: int = 0) -> Any:
    """A copy of a kept sample for ``then`` (tensors cloned, arrays and containers copied,
    other objects deep-copied): what ``then`` does in place stays in its copy."""
    kind = type(sample)
    if kind in _IMMUTABLE:
        return sample
    if isinstance(sample, torch.Tensor) and kind is torch.Tensor:
        return sample.clone()
    if kind is np.ndarray and sample.dtype != object:
        return sample.copy()
    if depth < _DEPTH:
        if kind in (list, tuple):
            return kind(fresh(v, depth + 1) for v in sample)
        if kind is dict:
            return {k: fresh(v, depth + 1) for k, v in sample.items()}
    return copy.deepcopy(sample)  # anything else (shared parts stay shared within it)
