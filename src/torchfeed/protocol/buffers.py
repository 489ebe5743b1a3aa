"""Reusable memory blocks for large messages and batches.

Fresh large allocations are expensive: the kernel must map and zero every page (about
18 ms for a 38.5 MB batch here, against 4 ms to fill memory already mapped). Both ends
of the data plane allocate such blocks for every batch: the worker when it stacks a
batch, the trainer when it receives one. A :class:`BlockPool` hands out views of cached
blocks and takes a block back automatically when the last tensor or array using it is
garbage collected, so steady-state batches land in memory that is already mapped.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from .. import notices

ALIGN = 64  # every buffer of a message starts on a 64-byte boundary of its receive block
MIN_POOLED = 1 << 20  # smaller allocations are cheap enough for malloc
_GRAIN = 1 << 16  # block sizes are rounded up to this, so similar sizes share blocks


class BlockPool:
    """Cache of uint8 blocks, keyed by rounded size.

    Parameters
    ----------
    max_cached_bytes : int
        Free blocks beyond this total are released to the system.
    """

    def __init__(self, max_cached_bytes: int = 1 << 30):
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._cached = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def lease(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` whose block returns to the pool when the array,
        and every array, tensor or memoryview derived from it, is gone.
        """
        size = -(-max(nbytes, 1) // _GRAIN) * _GRAIN
        with self._lock:
            blocks = self._free.get(size)
            if blocks:
                block = blocks.pop()
                self._cached -= size
                self.hits += 1
            else:
                block = None
                self.misses += 1
        if block is None:
            block = np.empty(size, dtype=np.uint8)
        lease = block[:nbytes]
        weakref.finalize(lease, self._give_back, block)
        # numpy points a slice's .base straight at the array that owns the memory (the
        # block), skipping `lease`: slices would not keep the lease alive. An array over
        # a memoryview of the lease stops that collapse, so everything cut from it holds it.
        return np.frombuffer(_view(lease), dtype=np.uint8)

    @property
    def cached_bytes(self) -> int:
        """Bytes held in free blocks, waiting to be leased again."""
        return self._cached

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            if self._cached + block.nbytes > self.max_cached_bytes:
                return  # dropped: freed by numpy
            self._free.setdefault(block.nbytes, []).append(block)
            self._cached += block.nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._cached = 0


pool = BlockPool()


def _after_fork_in_child() -> None:
    # another thread of the parent may have held the lock at the fork: the child's copy
    # would stay locked forever (its cached blocks are still valid memory)
    pool._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_here = threading.local()


class Lender(Protocol):
    def lease(self, nbytes: int, fresh: list | None = None) -> np.ndarray | None: ...


@contextlib.contextmanager
def lending(lender: Lender | None) -> Iterator[list]:
    """Within this block, large arrays this thread allocates come from ``lender`` (a
    same-host connection's shared slots: a worker's batch is stacked straight into memory
    the trainer maps) while it has room, else from the pool. Yields the list of the slots
    leased in the block (what the reply may send without a copy)."""
    before = getattr(_here, "lender", None), getattr(_here, "fresh", None)
    fresh: list = []
    _here.lender, _here.fresh = lender, fresh
    try:
        yield fresh
    finally:
        _here.lender, _here.fresh = before


def empty_array(nbytes: int) -> np.ndarray:
    """A uint8 array of ``nbytes``, pooled when large."""
    if nbytes < MIN_POOLED:
        return np.empty(nbytes, dtype=np.uint8)
    lender = getattr(_here, "lender", None)
    if lender is not None:
        got = lender.lease(nbytes, _here.fresh)
        if got is not None:
            return got
    return pool.lease(nbytes)


def empty_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes``, pooled when large."""
    return torch.from_numpy(empty_array(nbytes))


def empty_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """Like ``torch.empty(shape, dtype=dtype)``, with pooled memory when large."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    if nbytes < MIN_POOLED:
        return torch.empty(shape, dtype=dtype)
    return empty_bytes(nbytes).view(dtype).view(shape)


# -- receive blocks ---------------------------------------------------------------------

_warned_pin = False


def cuda_pinnable() -> bool:
    """Whether page-locked memory can be had (CUDA is here); warns once where it is not."""
    global _warned_pin
    if torch.cuda.is_available():
        return True
    if not _warned_pin:
        _warned_pin = True
        notices.warn(
            "pin_memory=True but CUDA is not available: batches are received into ordinary memory instead"
        )
    return False


def check_pinnable(pin: bool) -> None:
    """Warn (once, at the user's line) when ``pin`` is asked for and cannot be had."""
    if pin:
        cuda_pinnable()


# page-locked bytes one message may have reserved before its bytes arrive: a reply's header
# announces its size, and page-locked memory is committed (and kept in torch's host cache)
# at once, so a larger reply is received into ordinary memory, whose pages are only taken as
# its records arrive, and copied into page-locked memory once it has all arrived (pinned)
PIN_AHEAD = 256 << 20


def _pinned(n: int) -> np.ndarray:
    return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()  # torch caches these


def _layout(lengths: Sequence[int]) -> tuple[list[int], int]:
    offsets = []
    total = 0
    for n in lengths:
        offsets.append(total)
        total += (n + ALIGN - 1) // ALIGN * ALIGN
    return offsets, total


def allocate(lengths: Sequence[int], pin: bool = False, *, arrived: bool = False) -> list[memoryview]:
    """One block holding every buffer of a message, each 64-byte aligned.

    With ``pin=True`` and CUDA available the block is page-locked host memory, so the
    tensors rebuilt from it can be copied to the GPU asynchronously: at once for messages
    of at most :data:`PIN_AHEAD` bytes, else only when its bytes have ``arrived`` (the
    receiver calls :func:`pinned` after receiving into ordinary memory).
    """
    offsets, total = _layout(lengths)
    if pin and (arrived or total <= PIN_AHEAD) and cuda_pinnable():
        arr = _pinned(max(total, 1))
    else:
        arr = empty_array(max(total, 1))
    return [_view(arr[o : o + n]) for o, n in zip(offsets, lengths)]


def pinned(views: list[memoryview], lengths: Sequence[int], pin: bool) -> list[memoryview]:
    """A received message's buffers in page-locked memory when ``pin`` asked for it and
    :func:`allocate` could not reserve it ahead (a copy, made now that the bytes are here)."""
    if not pin or _layout(lengths)[1] <= PIN_AHEAD or not cuda_pinnable():
        return views
    out = allocate(lengths, pin, arrived=True)
    for src, dst in zip(views, out):
        dst[:] = src
    return out


def _view(arr: np.ndarray) -> memoryview:
    # numpy declares the buffer protocol to type checkers only for Python >= 3.12
    return memoryview(arr)  # type: ignore[arg-type,unused-ignore]
