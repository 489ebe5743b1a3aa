"""The parts of a RemoteDataset's membership that hold state of their own.

A :class:`~torchfeed.RemoteDataset` decides; these keep the books: who listens
(:class:`Listeners`, the running loader passes), which workers file is followed and what it
listed last (:class:`WatchedFile`), and which lost workers are retried when
(:class:`LostWorkers`, exponential backoff). None of them takes a lock: the dataset calls
them under its own.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Protocol

from ..client.connection import format_address
from ..protocol.addrfile import read_address_file
from ..util import double_delay

log = logging.getLogger("torchfeed.dataset")

BACKOFF_FIRST = 0.5  # seconds before a lost worker is tried again; doubled up to BACKOFF_MAX
BACKOFF_MAX = 10.0


class MembershipListener(Protocol):
    """What a dataset tells about its workers (loader passes implement it; see :meth:`RemoteDataset.subscribe`).

    Called from the thread that changed the membership (the user's, or the dataset's
    membership thread): implementations only record and wake, never block.
    """

    def worker_joined(self, address: str) -> None: ...

    def worker_removed(self, address: str) -> None: ...


class Listeners:
    """The listeners of one dataset, held weakly (a finished pass drops out)."""

    def __init__(self) -> None:
        self._set: weakref.WeakSet = weakref.WeakSet()

    def add(self, listener: MembershipListener) -> None:
        self._set.add(listener)

    def notify(self, address: str, joined: bool) -> None:
        """Tell every listener; one that fails is logged and the others are still told."""
        for listener in list(self._set):
            try:
                if joined:
                    listener.worker_joined(address)
                else:
                    listener.worker_removed(address)
            except Exception:
                log.exception("a loader could not take worker %s into account", address)


def read_workers_file(path: str) -> list[str]:
    """The addresses a workers file lists, normalised (``host:port``)."""
    return [format_address(a) for a in read_address_file(path)]


class WatchedFile:
    """A workers file followed by its size and modification time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp = self._read_stamp()

    def _read_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
            return st.st_mtime_ns, st.st_size
        except FileNotFoundError:
            return None

    def changed(self) -> list[str] | None:
        """The file's addresses if it changed since the last look, else None."""
        stamp = self._read_stamp()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        return read_workers_file(self.path)


class LostWorkers:
    """Lost workers with their last error and when each is tried next."""

    def __init__(self) -> None:
        self._entries: dict[str, dict] = {}  # address -> {"error", "next_try", "delay"}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, address: str) -> bool:
        return address in self._entries

    def mark(self, address: str, error: BaseException) -> None:
        self._entries[address] = {
            "error": repr(error),
            "next_try": time.monotonic() + BACKOFF_FIRST,
            "delay": BACKOFF_FIRST,
        }

    def forget(self, address: str) -> bool:
        """Stop retrying ``address``; False if it was not being retried."""
        return self._entries.pop(address, None) is not None

    def due(self, now: float) -> list[str]:
        return [w for w, v in self._entries.items() if v["next_try"] <= now]

    def failed_again(self, address: str, error: BaseException) -> None:
        entry = self._entries[address]
        entry["error"] = repr(error)
        entry["delay"] = double_delay(entry["delay"], BACKOFF_FIRST, BACKOFF_MAX)
        entry["next_try"] = time.monotonic() + entry["delay"]

    def errors(self) -> dict[str, str]:
        return {w: v["error"] for w, v in self._entries.items()}
