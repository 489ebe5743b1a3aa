"""Memory for the arrays and tensors a worker keeps in its sample cache.

A kept sample is memory the worker touches for the first time, and the first touch of
every 4 KiB page is a page fault: keeping 108 MB of decoded images costs about 27,600
faults and 85-100 ms of CPU on a 2-core VM, 4-5% of the epoch that decodes them. The cache
therefore copies the arrays and tensors of a sample it keeps into large chunks
(:func:`torchfeed.protocol.buffers.mapped`: advised to use transparent huge pages), where
the same 108 MB take about 60 faults and 35-100 ms, the copy included.

Chunks are filled in order, under a lock, and no part of one is handed out twice: every
array cut from a chunk holds the chunk, which is unmapped when its last array is dropped.
A kept sample is dropped only when the cache evicts it (entries of datasets no trainer
holds) or shrinks, so a chunk whose other samples are still kept keeps the memory of the
dropped ones until they go too: the cache's budget counts samples' bytes, not this slack.
"""

from __future__ import annotations

import os
import threading

import numpy as np

from ..protocol.buffers import ALIGN, mapped

CHUNK = 32 << 20  # bytes mapped at a time; a larger sample gets a mapping of its own


class Arena:
    """Hands out uint8 arrays from chunks mapped :data:`CHUNK` bytes at a time (thread-safe)."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._lock = threading.Lock()
        self._current: np.ndarray | None = None
        self._used = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A new uint8 array of ``nbytes`` (its start 64-byte aligned), in a chunk."""
        if nbytes > self.chunk // 4:
            return mapped(nbytes)
        with self._lock:
            if self._current is None or self._used + nbytes > self._current.nbytes:
                self._current, self._used = mapped(self.chunk), 0
            start = self._used
            self._used = -(-(start + nbytes) // ALIGN) * ALIGN
            return self._current[start : start + nbytes]

    def after_fork(self) -> None:
        """In a forked child: a lock the parent held stays held; the chunk is copy-on-write."""
        self._lock = threading.Lock()
        self._current, self._used = None, 0


arena = Arena()  # this process's

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=arena.after_fork)
