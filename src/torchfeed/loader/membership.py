"""A RemoteDataset's membership: which workers serve it, and the books behind that.

:class:`Membership` owns the list of workers, who listens (:class:`Listeners`, the running
loader passes), the followed workers file or DNS name (:class:`WatchedFile`), the lost
workers retried with exponential backoff (:class:`LostWorkers`) and the thread that does
the following and the retrying. Its owner (the dataset) gives it two functions: one that
builds the dataset on workers, one that drops a worker's built instance; everything else
about who serves is decided here.

A followed listing (file or name) is a claim, not a list of workers: an address it lists
becomes a worker only once the dataset is built there. One that cannot be built on (it
refuses, does not answer, fails the handshake: no torchfeed worker, or not yet) is
*skipped*: said once at WARNING under ``torchfeed.workers``, tried again with backoff, never
in :attr:`Membership.workers`. Workers the listing no longer names are drained only while
it names at least one serving worker: a listing of strays alone drains nothing (said once
at WARNING), so the running passes go on with the workers they have.

NOTE (threads and locks): the membership thread (``torchfeed-membership``) runs only while
there is a file or name to follow or a lost worker to retry, and ends when the membership
is garbage (it holds it weakly) or closed. It builds and notifies with no lock held; the
membership's lock guards its own books only, and the owner's functions are called without
it (they take the owner's lock), so the order is never owner -> membership -> owner.
Listeners are called from the thread that changed the membership and only record and wake.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .. import events
from ..client.addresses import format_address, parse_address
from ..errors import WorkerLost
from ..protocol.addrfile import read_address_file
from ..util import double_delay

log = logging.getLogger("torchfeed.dataset")
workers_log = logging.getLogger("torchfeed.workers")

BACKOFF_FIRST = 0.5  # seconds before a lost worker is tried again; doubled up to BACKOFF_MAX
BACKOFF_MAX = 10.0
# a listed address that is no worker is more likely a stray than a worker still starting
# (listings name ready workers): its tries back off further, holding the thread less
SKIPPED_BACKOFF_MAX = 60.0
TICK = 0.25  # seconds between rounds of the membership thread
PROBE_TIMEOUT = 2.0  # seconds a lost worker's cheap connect probe may take before a rebuild


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
    """Lost workers with their last error and when each is tried next (backing off up to
    ``most`` seconds)."""

    def __init__(self, most: float = BACKOFF_MAX) -> None:
        self._entries: dict[str, dict] = {}  # address -> {"error", "next_try", "delay"}
        self._most = most

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, address: str) -> bool:
        return address in self._entries

    def addresses(self) -> list[str]:
        return list(self._entries)

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
        entry["delay"] = double_delay(entry["delay"], BACKOFF_FIRST, self._most)
        entry["next_try"] = time.monotonic() + entry["delay"]

    def errors(self) -> dict[str, str]:
        return {w: v["error"] for w, v in self._entries.items()}


class Membership:
    """Which workers serve one dataset; it follows a workers file or name and brings lost
    workers back (see the module's NOTE).

    ``build(workers, strict=False)`` builds the dataset on ``workers`` without waiting for
    refused connections and returns the workers it failed on; ``build(workers, strict=False,
    found=True)`` does so for addresses a followed listing named (one that fails the handshake
    is returned, not raised); ``drop(address)`` forgets a worker's built instance. Both are held
    weakly (bound methods of the owner), so the membership keeps no dataset alive; a copy of
    the dataset (which shares its built instances and this membership) binds its own, and any
    live owner's are used. ``skipped`` are listed addresses that failed already, with why.
    """

    def __init__(
        self,
        workers: Sequence[str],
        build: Callable[..., dict[str, BaseException]],
        drop: Callable[[str], None],
        watched: WatchedFile | Any | None = None,
        skipped: dict[str, BaseException] | None = None,
    ) -> None:
        self.workers: list[str] = list(workers)
        self.watched = watched  # a WatchedFile or a dnsnames.WatchedName
        self.closed = False
        self.listeners = Listeners()
        self._owners: list[tuple[weakref.WeakMethod, weakref.WeakMethod]] = []
        self.bind(build, drop)
        self._fresh()
        for address in self.workers:  # built just now: not what this process saw there before
            events.set_state(address, "serving")  # [stats hook] (a reused port's lost worker)
        for address, error in (skipped or {}).items():
            self._skip(address, error)
        if watched is not None:
            self._ensure_thread()

    def bind(self, build: Callable[..., dict[str, BaseException]], drop: Callable[[str], None]) -> None:
        """Add an owner's functions (a copy's, or the owner's again after a pickle)."""
        self._owners = [(b, d) for b, d in self._owners if b() is not None]
        self._owners.append((weakref.WeakMethod(build), weakref.WeakMethod(drop)))

    def _owner(self) -> tuple[Callable[..., dict[str, BaseException]], Callable[[str], None]] | None:
        for build, drop in self._owners:
            b, d = build(), drop()
            if b is not None and d is not None:
                return b, d
        return None

    def owned(self) -> bool:
        """Whether an owner is alive (the thread ends when none is)."""
        return self._owner() is not None

    def _fresh(self) -> None:
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self.lost = LostWorkers()
        self.skipped = LostWorkers(SKIPPED_BACKOFF_MAX)  # listed, no worker (yet): never in workers
        # workers the listing stopped naming: drained once it names a serving worker
        self._unlisted: list[str] = []
        self._keeping = False  # whether the warning that they are kept was said

    def forget_process(self) -> None:
        """In a forked child: the parent's lock, thread and retries are of no use here."""
        self._fresh()

    def __getstate__(self) -> dict:
        return {"workers": list(self.workers), "watched": self.watched, "closed": self.closed}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.listeners = Listeners()
        self._owners = []  # the unpickled owner binds itself
        self._fresh()

    # -- what the owner asks --------------------------------------------------------------
    def current(self) -> list[str]:
        with self._lock:
            return list(self.workers)

    def add(self, workers: Sequence[str]) -> list[str]:
        """Build on the workers not served yet and tell the listeners; unreachable ones are
        retried in the background. Returns the workers that joined now."""
        with self._lock:
            new = [w for w in dict.fromkeys(workers) if w not in self.workers]
            self.workers.extend(new)
            for w in new:
                self.skipped.forget(w)  # added by hand: built on here, retried as a worker
        if not new:
            return []
        failed = self._call_build(new)
        for w, exc in failed.items():
            self.mark_lost(w, exc)
        joined = [w for w in new if w not in failed]
        for w in joined:
            events.worker_joined(w)  # [stats hook]
            self.listeners.notify(w, joined=True)
        events.flush()
        return joined

    def remove(self, workers: Sequence[str]) -> None:
        """Stop using these workers: listeners drain them (their batches finish)."""
        gone = list(workers)
        with self._lock:
            self.workers = [w for w in self.workers if w not in gone]
            self._unlisted = [w for w in self._unlisted if w not in gone]
            for w in gone:
                self.lost.forget(w)
                self.skipped.forget(w)
        for w in gone:
            self._call_drop(w)
            events.worker_drained(w)  # [stats hook]
            self.listeners.notify(w, joined=False)
        events.flush()

    def worker_lost(self, address: str, error: BaseException) -> None:
        """A worker's connection failed: retry it with backoff (once, however many report it)."""
        with self._lock:
            if address not in self.workers or address in self.lost:
                return
        self.mark_lost(address, error)

    def mark_lost(self, address: str, error: BaseException) -> None:
        with self._lock:
            self.lost.mark(address, error)
        self._call_drop(address)
        self._ensure_thread()

    def lost_errors(self) -> dict[str, str]:
        with self._lock:
            return self.lost.errors()

    def watch_file(self, path: str) -> None:
        with self._lock:
            self.watched = WatchedFile(path)
        self._ensure_thread()

    def close(self) -> None:
        """Stop following the file or name and retrying lost workers (the thread ends)."""
        self.closed = True

    # -- the membership thread --------------------------------------------------------------
    def _call_build(self, workers: Sequence[str], found: bool = False) -> dict[str, BaseException]:
        owner = self._owner()
        if owner is None:  # every owner is gone: nothing is built, nothing joins
            return {w: WorkerLost(f"the dataset served by {w} is gone") for w in workers}
        if found:
            return owner[0](workers, strict=False, found=True)
        return owner[0](workers, strict=False)

    def _call_drop(self, address: str) -> None:
        owner = self._owner()
        if owner is not None:
            owner[1](address)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_membership_loop,
                    args=(weakref.ref(self),),
                    name="torchfeed-membership",
                    daemon=True,
                )
                self._thread.start()

    def _poll_watched(self) -> None:
        listed = self.watched.changed() if self.watched is not None else None
        if listed is not None:
            self._follow(listed)
        self._drain_unlisted()

    def _follow(self, listed: Sequence[str]) -> None:
        """A new listing: build on the addresses it adds; the workers it no longer names are
        drained by :meth:`_drain_unlisted`; skipped addresses it no longer names are forgotten."""
        with self._lock:
            for w in self.skipped.addresses():
                if w not in listed:
                    self.skipped.forget(w)
            self._unlisted = [w for w in self.workers if w not in listed]
            fresh = [w for w in dict.fromkeys(listed) if w not in self.workers and w not in self.skipped]
        if fresh:
            self._join_listed(fresh)

    def _join_listed(self, fresh: Sequence[str]) -> None:
        """Build on listed addresses: those that build join, the others are skipped."""
        try:
            failed = self._call_build(fresh, found=True)
        except Exception as exc:  # noqa: BLE001 - e.g. the dataset fails there: said, tried again later
            failed = {w: exc for w in fresh}
        for w, why in failed.items():
            self._skip(w, why)
        joined = [w for w in fresh if w not in failed]
        with self._lock:
            self.workers.extend(w for w in joined if w not in self.workers)
        for w in joined:
            events.worker_joined(w)  # [stats hook]
            self.listeners.notify(w, joined=True)
        events.flush()

    def _skip(self, address: str, error: BaseException) -> None:
        """A listed address that is no worker (yet): said once, tried again with backoff."""
        with self._lock:
            if address in self.skipped:
                self.skipped.failed_again(address, error)
                return
            self.skipped.mark(address, error)
        where = self.watched.path if self.watched is not None else "the workers' listing"
        workers_log.warning(
            "skipping %s, listed by %s: %s. It is not used; it is tried again with backoff and joins "
            "once the dataset can be built there",
            address,
            where,
            error,
        )
        self._ensure_thread()

    def _drain_unlisted(self) -> None:
        """Drain the workers the listing stopped naming, but only while it names a serving worker."""
        with self._lock:
            unlisted = [w for w in self._unlisted if w in self.workers]
            serving = [w for w in self.workers if w not in self._unlisted and w not in self.lost]
            if not unlisted:
                self._unlisted, self._keeping = [], False
                return
            keep_saying = not serving and not self._keeping
            self._keeping = not serving
        where = self.watched.path if self.watched is not None else "the workers' listing"
        if keep_saying:
            workers_log.warning(
                "%s lists no reachable worker now; keeping the %d worker(s) it no longer lists (%s) "
                "until it lists one (the addresses it lists are tried meanwhile)",
                where,
                len(unlisted),
                ", ".join(unlisted),
            )
        if serving:
            self.remove(unlisted)

    def _retry_skipped(self) -> None:
        """Try the skipped addresses that are due, all in one build (each one's connection
        bounded, concurrently: a stray that stalls its handshake holds back no other)."""
        with self._lock:
            due = self.skipped.due(time.monotonic())
        if not due:
            return
        try:
            failed = self._call_build(due, found=True)
        except Exception as exc:  # noqa: BLE001 - any failure means: try them later
            failed = dict.fromkeys(due, exc)
        for w in due:
            with self._lock:
                if w not in self.skipped:
                    continue  # no longer listed meanwhile
                if w in failed:
                    self.skipped.failed_again(w, failed[w])
                    continue
                self.skipped.forget(w)
                if w not in self.workers:
                    self.workers.append(w)
            events.worker_joined(w)  # [stats hook]
            self.listeners.notify(w, joined=True)

    def _retry_lost(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = self.lost.due(now)
        for w in due:
            try:  # cheap probe first: a build waits for the full timeout
                _probe(w)
                events.worker_reconnecting(w)  # [stats hook]
                failed = self._call_build([w])
            except Exception as exc:  # noqa: BLE001 - any failure means: try later
                failed = {w: exc}
            with self._lock:
                if w not in self.lost:
                    continue  # removed meanwhile
                if w in failed:
                    if events.state_of(w) == "reconnecting":
                        events.set_state(w, "lost")
                    self.lost.failed_again(w, failed[w])
                    continue
                self.lost.forget(w)
            events.worker_joined(w)  # [stats hook] logged as "worker ... is back"
            self.listeners.notify(w, joined=True)

    def tick(self) -> None:
        """One round of background work."""
        events.flush()  # [stats hook] events noticed on reader threads reach the log here too
        if self.closed:
            return
        if self.watched is not None:
            try:
                self._poll_watched()
            except Exception as exc:  # noqa: BLE001 - keep watching
                log.warning("could not use the workers file %s: %s", self.watched.path, exc)
        self._retry_skipped()
        self._retry_lost()

    def idle(self) -> bool:
        """True (and the thread forgotten) when there is nothing left to follow or retry;
        decided under the lock that :meth:`mark_lost` takes before starting a thread."""
        with self._lock:
            if self.closed or not (self.watched or self.lost or self.skipped):
                self._thread = None
                return True
            return False


def _probe(address: str) -> None:
    """Connect and close at once (OSError if nothing answers): cheap, where a build waits longer."""
    host, port = parse_address(address)
    socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()


def _membership_loop(ref: weakref.ref[Membership]) -> None:
    while True:
        time.sleep(TICK)
        members = ref()
        if members is None or not members.owned():
            return
        try:
            members.tick()
        except Exception:
            log.exception("torchfeed membership thread")
        if members.idle():
            return
        del members
