"""The first batch of a pass, split across the workers, and joined again in the trainer.

A pass's first batch is the one the trainer waits for with nothing else to do: built by one
worker, it costs what that worker takes for a whole batch. So a map-style pass with several
workers and torch's ``default_collate`` cuts its first batch's keys into as many contiguous
parts as it has workers; each part is an ordinary batch for the scheduler (dispatched,
retried, hedged like any other), and the consumer takes them together and hands the user
one batch: :func:`join` puts the parts' collated values back together, structure by
structure, into what ``default_collate`` makes of the whole list (a tensor stacked from the
samples equals the concatenation of the stacks of its parts; lists of strings are
concatenated; mappings, tuples, named tuples and sequences are joined member by member).
Later batches are whole, as before.

A custom ``collate_fn`` is never split: nothing says how its outputs join.

Tensors are joined on the consumer's thread alone (:func:`_cat`): torch's intra-op threads
would wait for cores the workers keep busy building the next batches (on 2 cores, joining
two 2.4 MB parts with ``torch.cat`` stalled 15-35 ms in a third of first batches; on one
thread it takes under 1 ms). A joined batch is pinned when its parts are.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np
import torch


def parts_of(keys: Sequence[Any], workers: int) -> list[list[Any]]:
    """``keys`` cut into at most ``workers`` contiguous, nearly equal parts (one part when
    there is nothing to share)."""
    keys = list(keys)
    k = max(1, min(workers, len(keys)))
    size, extra = divmod(len(keys), k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (i < extra)
        out.append(keys[start:end])
        start = end
    return out


def join(parts: Sequence[Any]) -> Any:
    """The ``default_collate`` value of the whole batch from those of its parts, in order."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return _cat(list(parts))
    if isinstance(first, Mapping):  # keeps the mapping's type, as default_collate does
        joined = {key: join([p[key] for p in parts]) for key in first}
        if isinstance(first, MutableMapping):
            clone = copy.copy(first)
            clone.update(joined)
            return clone
        try:
            return type(first)(joined)  # type: ignore[call-arg]
        except TypeError:
            return joined
    if isinstance(first, tuple) and type(first) is not tuple:  # a named tuple (collate keeps those)
        return type(first)(*(join(column) for column in zip(*parts)))
    if isinstance(first, (str, bytes)):
        raise TypeError(f"cannot join collated parts of type {type(first).__name__}")
    if isinstance(first, Sequence):
        if all(isinstance(item, (str, bytes)) for p in parts for item in p):
            # a batch of strings comes back as it went in: a list, or a column's tuple
            items = [item for p in parts for item in p]
            return tuple(items) if isinstance(first, tuple) else items
        columns = [join(list(column)) for column in zip(*parts)]
        if type(first) is list:
            return columns
        if isinstance(first, MutableSequence):  # a list type of the user's: as default_collate keeps it
            seq = copy.copy(first)
            for i, column in enumerate(columns):
                seq[i] = column
            return seq
        return columns
    raise TypeError(f"cannot join collated parts of type {type(first).__name__}")


# the dtypes numpy copies bit for bit (not bfloat16, float8 or quantized ones: torch.cat joins those)
_NUMPY_DTYPES = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    + (torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128)
)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, copied by this thread alone, pinned if the parts are."""
    first = parts[0]
    pinned = first.is_pinned()
    plain = (
        first.device.type == "cpu"
        and first.dtype in _NUMPY_DTYPES
        and first.layout == torch.strided
        and all(
            type(p) is torch.Tensor  # a subclass stays one through torch.cat
            and p.dtype == first.dtype
            and p.device == first.device
            and p.layout == torch.strided
            and p.shape[1:] == first.shape[1:]
            and not (p.requires_grad or p.is_conj() or p.is_neg())
            for p in parts
        )
    )
    if not plain:
        out = torch.cat(parts, dim=0)
        return out.pin_memory() if pinned and not out.is_pinned() else out
    out = torch.empty((sum(len(p) for p in parts), *first.shape[1:]), dtype=first.dtype, pin_memory=pinned)
    np.concatenate([p.numpy() for p in parts], axis=0, out=out.numpy())
    return out
