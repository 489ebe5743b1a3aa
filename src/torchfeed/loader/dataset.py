"""RemoteDataset: a dataset whose instances live on workers, with changing membership.

Workers can join (``add_workers``, or lines appended to a watched workers file), leave
(``remove_workers``: drained, nothing lost), die and come back: a lost worker is retried
with backoff, and when a worker answers again at that address the dataset is rebuilt
there and every running loader pass starts using it, within the same epoch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from torch.utils.data import Dataset, IterableDataset

from .. import client
from ..client import building, reach, wait_all
from ..errors import AuthenticationError, RemoteError, SerializationError, Timeout, WorkerLost
from ..protocol.addrfile import check_folder
from ..protocol.auth import SecretLike
from . import cache, dnsnames, reported
from .membership import Membership, MembershipListener, read_workers_file

if TYPE_CHECKING:
    from ..client.session import Session

log = logging.getLogger("torchfeed.dataset")


T_co = TypeVar("T_co", covariant=True)

FILE_POLL = 0.1  # seconds between two reads of a workers file that lists too few workers


def _file_state(path: str, listed: int, min_workers: int) -> str:
    """Why workers file ``path`` (listing ``listed`` workers) cannot be used yet, in words."""
    if not os.path.lexists(path):
        return "does not exist"
    if not listed:
        return "is empty"
    return f"lists {listed} of the {min_workers} workers needed"


def _wait_for_file(path: str, min_workers: int, timeout: float) -> list[str]:
    """The addresses of workers file ``path`` once it lists at least ``min_workers``.

    Waits up to ``timeout`` seconds for workers that start after the trainer, and says so
    as the direct-address path does (:mod:`torchfeed.client.reach`): a WARNING under
    ``torchfeed.workers`` at once, again every ``reach.REFUSED_LOG_EVERY`` seconds, and a
    :class:`~torchfeed.Timeout` naming what the file still lacks. A folder that does not
    exist is not waited for (FileNotFoundError at once)."""
    check_folder(path)
    start = time.monotonic()
    deadline = start + timeout
    next_line: float | None = None
    while True:
        workers = read_workers_file(path)
        if len(workers) >= min_workers:
            return workers
        now = time.monotonic()
        state = _file_state(path, len(workers), min_workers)
        if now >= deadline:
            raise Timeout(
                f"the workers file {path} {state} after waiting {timeout:g} s: workers write their addresses "
                f"there when started with `torchfeed worker --address-file {path}` (on a filesystem this "
                "trainer shares). Start them, or wait longer (from_file(..., wait_timeout=seconds))"
            )
        if next_line is None:
            reach.log.warning(
                "workers file %s %s; waiting up to %.3g s for workers to write it "
                "(`torchfeed worker --address-file %s`)",
                path,
                state,
                deadline - now,
                path,
            )
            next_line = now + reach.REFUSED_LOG_EVERY
        elif now >= next_line:
            reach.log.warning(
                "workers file %s %s after %.3g s; waiting %.3g s more",
                path,
                state,
                now - start,
                deadline - now,
            )
            next_line = now + reach.REFUSED_LOG_EVERY
        time.sleep(min(FILE_POLL, deadline - now))


_rebuild_lock = threading.Lock()  # one rebuild at a time in a forked or spawned process


def _renew_rebuild_lock() -> None:
    global _rebuild_lock
    _rebuild_lock = threading.Lock()  # a parent thread may have held it at the fork


os.register_at_fork(after_in_child=_renew_rebuild_lock)


class _SessionTimeout:
    """``RemoteDataset.timeout`` before construction: read on the class, the default
    session's timeout; on an instance not given one yet, None (then the instance's session's).
    Assigning the class attribute replaces it for the datasets built afterwards."""

    def __get__(self, obj, objtype=None) -> float | None:
        return client.default_session().timeout if obj is None else None


class RemoteDataset(Dataset[T_co]):
    """A dataset built on remote workers.

    ``RemoteDataset(workers, dataset, *args, **kwargs)`` calls ``dataset(*args, **kwargs)``
    on every worker, concurrently, and keeps the instances there. ``dataset`` may be a
    class or any callable returning a map-style (or iterable-style) dataset; it may be
    defined in ``__main__`` or locally (it travels by value). Workers that refuse
    connections (not started yet) are retried until ``timeout``.

    It is a ``torch.utils.data.Dataset``: ``Subset``, ``random_split`` and ``ConcatDataset``
    of RemoteDatasets can be given to :class:`RemoteDataLoader` (indices are mapped in the
    trainer).

    Parameters
    ----------
    workers : list of str
        Worker addresses ``host:port`` (or one space-separated string), or a DNS name
        ``dns://NAME:PORT`` whose A/AAAA records are the workers, followed as they change
        (:mod:`torchfeed.loader.dnsnames`: a Kubernetes headless Service).
    dataset : callable
        Dataset class or factory.
    *args, **kwargs
        Passed to ``dataset`` on each worker, except the keywords ``session`` and ``timeout``,
        which are RemoteDataset's own.
    session : Session, optional
        Keyword-only: the :class:`~torchfeed.Session` whose connections, secret and
        timeout this dataset (and the loaders over it) use; the default session if None.
    timeout : float, optional
        Keyword-only: seconds allowed to connect (workers that refuse connections, not
        started yet, are tried again that long), build the dataset and make calls; the
        session's if None. It never reaches ``dataset``. When ``dataset`` takes a
        ``timeout`` parameter of its own, ``timeout=`` is ambiguous and raises TypeError:
        give the dataset's with the factory, ``functools.partial(dataset, timeout=...)``,
        and this one with the session, ``session=torchfeed.Session(timeout=...)``.

    Attributes
    ----------
    timeout : float
        Seconds allowed to connect (workers starting late), build the dataset and make
        calls: ``timeout=`` if given, else the session's timeout (unless set on the class
        before construction, or on the instance afterwards).
    secret
        The shared secret: the session's unless set here.
    """

    # read on the class: the default session's (120 unless changed); an instance holds a number
    timeout: float = _SessionTimeout()  # type: ignore[assignment]
    secret: SecretLike = None  # None: the session's

    def __init__(
        self: RemoteDataset[Any],  # what the workers' datasets return is not known here
        workers: Sequence[str],
        dataset: Callable,
        *args,
        session: Session | None = None,
        timeout: float | None = None,
        **kwargs,
    ):
        name = dnsnames.name_of(workers)  # dns://: resolved and built on below
        if name is None:
            if isinstance(workers, str):
                workers = workers.split()
            workers = [client.format_address(w) for w in workers]
            if not workers:
                raise ValueError("RemoteDataset needs at least one worker address (host:port)")
            if len(set(workers)) != len(workers):
                raise ValueError(f"worker addresses are repeated: {workers}")
        building.check_factory(dataset)
        building.check_timeout(dataset, timeout)
        building.check_picklable(dataset, args, kwargs)
        self.session = session if session is not None else client.default_session()
        if timeout is not None:
            self.timeout = float(timeout)
        if self.timeout is None:
            self.timeout = self.session.timeout
        if self.secret is None:
            self.secret = self.session.secret
        self.factory = dataset
        self.iterable = False  # set from the built instances: an IterableDataset
        self.args = args
        self.kwargs = kwargs
        self._refs: dict[str, client.RemoteRef] = {}
        self._length: int | None = None
        self._lock = threading.RLock()  # guards _refs, _length and iterable
        self._pid = os.getpid()  # the process whose connections own the built datasets
        named: dnsnames.WatchedName | None = None
        skipped: dict[str, BaseException] = {}
        if name is None:
            self._build_on(workers, strict=True, wait=True)
        else:  # the listed addresses that are no worker (yet) are skipped, not used
            workers, skipped, named = dnsnames.first_workers(name, self._build_found, self.timeout)
        # who serves, followed (a dns:// name's records, a workers file) and retried
        self._members = Membership(workers, self._build_on, self._drop_ref, watched=named, skipped=skipped)

    @property
    def workers(self) -> list[str]:
        """The addresses of the workers serving this dataset (lost ones being retried included)."""
        return self._members.workers

    def __getstate__(self) -> dict:
        """A pickled RemoteDataset (torch's DataLoader workers started with ``spawn``) carries
        its addresses, factory, arguments and settings; the datasets are built again in the
        process that loads it, on that process's default session. An explicit secret does
        not travel (a pickle may be written anywhere): the receiving process discovers it
        (``TORCHFEED_SECRET``, ``TORCHFEED_SECRET_FILE`` or the default file)."""
        state = self.__dict__.copy()
        for name in ("_lock", "_refs", "session"):
            del state[name]
        state["secret"] = None
        state["_pid"] = None  # built nowhere yet for the receiving process
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.session = client.default_session()
        self._forget_built()
        self._members.bind(self._build_on, self._drop_ref)

    def _forget_built(self) -> None:
        """This process's state before any build: another process's locks, membership
        thread and remote objects are of no use here."""
        self._lock = threading.RLock()
        self._refs = {}
        self._members.forget_process()

    def __copy__(self) -> RemoteDataset:
        """A copy in this process is another handle on the same built datasets, session and
        secret (only a pickle, which may leave the process, drops them)."""
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin._members.bind(twin._build_on, twin._drop_ref)
        return twin

    def __deepcopy__(self, memo: dict) -> RemoteDataset:
        return self.__copy__()  # the data lives on the workers: nothing here to copy deeply

    def _own_process(self) -> None:
        """In a process forked from the one that built this dataset (torch's DataLoader
        workers, ``num_workers > 0``), the built datasets belong to the parent's connections,
        which the child may not use: build them again for this process, once (other threads
        wait; a failed build is tried again by the next call)."""
        if self._pid == os.getpid():
            return
        with _rebuild_lock:
            if self._pid == os.getpid():
                return
            self._forget_built()  # the parent's remote objects go with the parent's connections
            log.info("process %d: building %r again on its workers", os.getpid(), self)
            self._build_on(self.workers, strict=True, wait=True)
            self._pid = os.getpid()

    # -- building ---------------------------------------------------------------
    def _build_on(
        self, workers: Sequence[str], strict: bool, wait: bool = False, found: bool = False
    ) -> dict[str, BaseException]:
        """Build on ``workers``; return the unreachable ones (raise if ``strict``).

        With ``wait``, refused connections are retried until ``timeout`` first; without, a
        refusal fails that worker at once (the caller retries it in the background). With
        ``found`` (addresses a DNS name listed: any of them may be no worker), each is tried
        once and briefly, and one that fails the handshake is returned among the failures,
        not raised (:func:`~torchfeed.client.building.connect_found`).
        """
        if found:
            unreachable = building.connect_found(workers, self.secret, self.timeout, self.session)
        elif wait:
            unreachable = building.connect_all(workers, self.secret, self.timeout, self.session)
        else:
            unreachable = {}
        futs = {
            w: self.session.rpc_async(
                w,
                building.build,
                args=(self.factory, self.args, self.kwargs),
                rref=True,
                timeout=self.timeout,
                secret=self.secret,
                wait_for_worker=False,  # refused: lost, retried by the membership thread
            )
            for w in workers
            if w not in unreachable
        }
        built = wait_all(futs, self.timeout)
        built.update(unreachable)
        errors = {w: v for w, v in built.items() if isinstance(v, BaseException)}
        for w, v in errors.items():  # (connect_all raised the failures to connect that must be)
            if found:
                break  # listed addresses: each one's failure is its own (the others still join)
            if w not in unreachable and isinstance(v, (RemoteError, AuthenticationError, SerializationError)):
                raise v  # the dataset itself fails, or the setup is wrong: retrying cannot help
        if errors and strict:
            first = next(iter(errors.values()))
            raise WorkerLost(
                "could not build the dataset on " + ", ".join(f"{w} ({e})" for w, e in errors.items()),
                {w: repr(e) for w, e in errors.items()},
            ) from first
        built = {w: v for w, v in built.items() if w not in errors}
        described = wait_all(
            {
                w: self.session.rpc_async(
                    w, building.describe, args=(ref,), timeout=self.timeout, secret=self.secret
                )
                for w, ref in built.items()
            },
            self.timeout,
        )
        for w, d in list(described.items()):
            if isinstance(d, BaseException) and found:
                errors[w] = d  # that address's failure alone
                del described[w], built[w]
                continue
            if isinstance(d, BaseException):
                raise d
            reported.check_description(w, d)
        lengths = {w: d[1] for w, d in described.items()}
        with self._lock:
            distinct = set(lengths.values())
            if self._refs or self._length is not None:
                distinct.add(self._length)
            if len(distinct) > 1:
                raise ValueError(
                    f"workers built datasets of different lengths {lengths} (expected "
                    f"{self._length}): every worker must see the same data"
                )
            if distinct:
                self._length = distinct.pop()
            self.iterable = self.iterable or any(d[0] for d in described.values())
            if self.iterable and not isinstance(self, IterableDataset):
                # frameworks tell iterable-style data by isinstance (Lightning then injects no sampler)
                self.__class__ = RemoteIterableDataset
            self._refs.update(built)
            refs = dict(self._refs) if built and cache.is_cached(self.factory) else None
        if refs:  # a cached dataset: every worker learns its peers' lanes (one cache across them)
            cache.link_peers(self.session, refs, self.timeout, self.secret)
        return errors

    def _build_found(self, workers: Sequence[str]) -> dict[str, BaseException]:
        """Build on addresses a DNS name listed; return those that are no worker (yet)."""
        return self._build_on(workers, strict=False, found=True)

    def _drop_ref(self, address: str) -> None:
        """Forget ``address``'s built instance (removed, or lost until rebuilt)."""
        with self._lock:
            self._refs.pop(address, None)

    # -- membership: kept by self._members ------------------------------------------------
    def add_workers(self, workers: Sequence[str]) -> list[str]:
        """Build the dataset on new workers; running loader passes start using them.

        Unreachable ones are retried in the background. Returns the workers added now.
        """
        return self._members.add([client.format_address(w) for w in workers])

    def remove_workers(self, workers: Sequence[str]) -> None:
        """Stop using these workers: running passes drain them (their batches finish)."""
        self._members.remove([client.format_address(w) for w in workers])

    def worker_lost(self, address: str, error: BaseException) -> None:
        """Called by loaders when a worker's connection failed: retry it with backoff."""
        self._members.worker_lost(address, error)

    def lost_workers(self) -> dict[str, str]:
        """Workers being retried, with their last error."""
        return self._members.lost_errors()

    def subscribe(self, listener: MembershipListener) -> None:
        """Call ``listener`` on membership changes (held weakly: a finished pass drops out)."""
        self._members.listeners.add(listener)

    @classmethod
    def from_file(
        cls, path: str, dataset: Callable, *args, min_workers: int = 1, wait_timeout: float = 300.0, **kwargs
    ) -> RemoteDataset:
        """Build on the workers listed in ``path`` (one ``host:port`` per line) and watch it.

        Waits up to ``wait_timeout`` seconds until at least ``min_workers`` addresses are
        listed (workers may start after the trainer: a missing or empty file is waited for,
        said under ``torchfeed.workers``); a folder that does not exist raises
        FileNotFoundError at once. Addresses appended later (for example by ``torchfeed
        worker --address-file path`` started by Slurm or Dask) join, addresses deleted from
        the file are drained.
        """
        ds = cls(_wait_for_file(path, min_workers, wait_timeout), dataset, *args, **kwargs)
        ds.watch_file(path)
        return ds

    def watch_file(self, path: str) -> None:
        """Follow the workers file ``path``: addresses appended join, addresses deleted are drained."""
        self._members.watch_file(path)

    def close(self) -> None:
        """Stop watching the workers file and retrying lost workers."""
        self._members.close()

    # -- dataset protocol ----------------------------------------------------------------
    def ref(self, address: str) -> client.RemoteRef:
        self._own_process()
        return self._refs[address]

    def alive_workers(self) -> list[str]:
        self._own_process()
        workers = self._members.current()
        with self._lock:
            return [w for w in workers if w in self._refs and self._refs[w].alive]

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError(f"{self!r} has no length: its dataset has no __len__")
        return self._length

    def __getitem__(self, index):
        """Fetch one sample (handy for inspection; the loader fetches whole batches)."""
        for w in self.alive_workers():
            return self.session.rpc_async(
                w, lambda ds, i: ds[i], args=(self._refs[w], index), timeout=self.timeout, secret=self.secret
            ).wait()
        raise WorkerLost(f"no worker of this dataset is reachable: {self.workers}")

    def run_on_workers(
        self, fn: Callable, *args, pass_worker_id: bool = False, pass_dataset: bool = False
    ) -> dict[str, Any]:
        """Run ``fn`` once on every reachable worker; return address -> result.

        ``fn`` gets ``*args``, then the worker's dataset instance if ``pass_dataset``,
        then the worker id (its index in ``workers``) if ``pass_worker_id``.
        """
        futs = {}
        for w in self.alive_workers():
            call_args = list(args)
            if pass_dataset:
                call_args.append(self._refs[w])
            if pass_worker_id:
                call_args.append(self.workers.index(w))
            futs[w] = self.session.rpc_async(
                w, fn, args=tuple(call_args), timeout=self.timeout, secret=self.secret
            )
        results = wait_all(futs, self.timeout)
        for v in results.values():
            if isinstance(v, BaseException):
                raise v
        return results

    def __repr__(self) -> str:
        name = getattr(self.factory, "__qualname__", repr(self.factory))
        return f"RemoteDataset({name}, workers={self.workers}, len={self._length})"


class RemoteIterableDataset(RemoteDataset, IterableDataset):
    """A :class:`RemoteDataset` whose workers built an iterable-style dataset: it becomes one when
    that is known (after its first build), so ``isinstance(ds, IterableDataset)`` holds as it does
    for the dataset it stands for. Iterate it with a :class:`~torchfeed.RemoteDataLoader`."""

    def __iter__(self):
        raise TypeError(
            "an iterable-style RemoteDataset is read through torchfeed.RemoteDataLoader(dataset, ...), "
            "which runs its streams on the workers"
        )
