"""Decode once: :func:`cached` datasets keep the deterministic part of a sample on the workers.

``RemoteDataset(workers, cached(Factory, then=augment), *args)`` builds ``Factory(*args)``
on every worker; ``dataset[i]`` is then ``then(Factory(*args)[i])``, where the inner
sample is computed once and kept in the worker's :mod:`~torchfeed.worker.samplestore` and
``then`` runs at every access under the loader's per-sample seed (so a cached pass gives
the batches an uncached one gives). For :class:`~torchfeed.datasets.Shards`, the decoded
samples of a whole shard are kept (``open_shard(url)`` read once) and ``then`` runs on
each sample as the stream yields it.

**Sharing.** Datasets built from equal pickles of ``(factory, args, kwargs)`` on one worker
share one instance (map-style) and one set of cached samples, whatever their ``then``:
two jobs of a hyperparameter search pay for one decode. So a kept sample is never given
to ``then`` itself: ``then`` gets a deep copy (:func:`copy_for_then`), which it may change in
place (``x.mul_(2)``) without changing what another job, or its own next epoch, receives
(read-only arrays too: ``torch.from_numpy`` of one is a writable tensor over its memory).
The copy costs about what copying the sample's bytes costs (a 3x224x224 float tensor:
17 us, a 3x16x16 one 3 us, on a 2-core machine), once per sample per access; without
``then`` the kept sample goes to the collate function as it is (default_collate copies
it into the batch).

**One cache across the pool.** A decoded sample is kept by the worker that decoded it, and
has an *owner* among the workers the trainer built the dataset on (rendezvous hashing of the
sample key over their lanes), which keeps it or a note of the peer that does. A worker
loading a batch asks the owners for the samples it does not keep, through their *lanes* (a
second, small authenticated server in every worker process that only reads the cache and
takes notes, so a lane never waits for an executor and peers cannot deadlock), and follows a
note to the keeper; the answers arrive while it loads the rest. A sample nobody has yet is
decoded where it is needed, kept there, and its owner told. A lane that fails is left out
for :data:`_DOWN_SECONDS` (its samples get other owners and are decoded again there). The
scheduler is unchanged: any worker can serve any batch, and losses, hedges and exactly-once
delivery work as without a cache.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from .. import client
from ..protocol import serialize
from ..worker import samplestore as store_module
from ..worker.lanes import lane_address, lane_get, lane_note
from ..worker.samplestore import MISSING

_DOWN_SECONDS = 30.0  # a peer lane that failed is not asked again for this long
_PEER_TIMEOUT = 10.0  # seconds a peer lane has to answer


def cached(factory: Callable, *, then: Callable | None = None) -> Cached:
    """A factory for :class:`~torchfeed.RemoteDataset` whose samples are computed once per pool.

    For example ``RemoteDataset(workers, torchfeed.cached(ImageFolder, then=augment), root,
    transform=decode)``; see the guide, *Decode once*.

    Parameters
    ----------
    factory : callable
        The dataset class (or a function returning a dataset) whose samples are
        deterministic: read, decode, resize. It must draw no random numbers.
    then : callable, optional
        Run on every access of a sample, after the cache: the random part (crops, flips,
        noise), under the loader's per-sample seed. It gets a copy of the cached sample,
        so it may work in place.
    """
    if isinstance(factory, Cached):
        raise TypeError("cached(cached(...)): the factory is already cached; pass the inner factory")
    if then is not None and not callable(then):
        raise TypeError(f"cached(then=...) must be callable (a function of one sample), got {then!r}")
    return Cached(factory, then)


class Cached:
    """What :func:`cached` returns: called on a worker, it builds (or reuses) the dataset."""

    def __init__(self, factory: Callable, then: Callable | None):
        self.factory = factory
        self.then = then
        name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
        self.__qualname__ = f"cached({name})"  # how building errors name it

    @property
    def __signature__(self) -> inspect.Signature:
        """The factory's: RemoteDataset's checks (a ``timeout`` parameter) look at it."""
        return inspect.signature(self.factory)

    def __call__(self, *args, **kwargs):
        meta, buffers = serialize.dumps((self.factory, args, kwargs), by_value=True)
        digest = hashlib.blake2b(meta, digest_size=16)
        for b in buffers:
            digest.update(b)
        key = digest.digest()
        shared = _shared_instance(key, self.factory, args, kwargs)
        if isinstance(shared.instance, IterableDataset):
            return _cached_shards(shared, self.then)
        return CachedDataset(shared, self.then)

    def __repr__(self) -> str:
        return f"cached({self.factory!r}, then={self.then!r})"


class Shared:
    """One dataset instance and its key in the worker's cache, held by the datasets built on it."""

    def __init__(self, key: bytes, instance: Any):
        self.key = key
        self.instance = instance
        store_module.store.hold(key)
        weakref.finalize(self, store_module.store.release, key)


_registry: weakref.WeakValueDictionary[bytes, Shared] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def _shared_instance(key: bytes, factory: Callable, args: tuple, kwargs: dict) -> Shared:
    with _registry_lock:
        found = _registry.get(key)
        if found is not None and not isinstance(found.instance, IterableDataset):
            return found  # map-style instances are shared; an iterable has per-stream state
    instance = factory(*args, **kwargs)  # outside the lock: building may take long
    with _registry_lock:
        found = _registry.get(key)
        if found is not None and not isinstance(instance, IterableDataset):
            return found
        shared = Shared(key, instance)
        if found is None:
            _registry[key] = shared
        return shared


class Counts(store_module.Tally):
    """A cached dataset's hits and misses on this worker (this trainer's view of it)."""

    def add(self, hit: bool) -> None:
        """Count one lookup here and in the worker's own figures."""
        self.tally(hit)
        store_module.store.tally(hit)


class Peers:
    """The lanes of the workers a dataset was built on, which of them owns a sample, and the
    calls to them (asks, notes)."""

    def __init__(self):
        self.lanes: list[str] = []
        self.me: str | None = None
        self._down: dict[str, float] = {}

    def set(self, lanes: list[str], me: str | None) -> None:
        self.lanes = sorted(lanes)
        self.me = me
        self._down = {}

    def owner(self, key: Any) -> str | None:
        """The lane of the worker that keeps track of ``key``; None: this one."""
        if self.me is None or len(self.lanes) < 2:
            return None
        now = time.monotonic()
        name = repr(key).encode()
        best, best_score = None, b""
        for lane in self.lanes:
            if lane != self.me and self._down.get(lane, 0.0) > now:
                continue
            score = hashlib.blake2b(name, digest_size=8, key=lane.encode()[:64]).digest()
            if score > best_score:
                best, best_score = lane, score
        return None if best == self.me else best

    def source(self, dataset: bytes, key: Any) -> str | None:
        """The lane to ask for a sample not kept here: its owner's, or, when this worker owns
        it, the lane its note names; None: nobody to ask (decode it)."""
        owner = self.owner(key)
        if owner is not None:
            return owner
        lane = store_module.store.where(dataset, key) if self.me is not None else None
        return lane if lane is not None and lane != self.me and not self.is_down(lane) else None

    def is_down(self, lane: str) -> bool:
        return self._down.get(lane, 0.0) > time.monotonic()

    def down(self, lane: str) -> None:
        self._down[lane] = time.monotonic() + _DOWN_SECONDS

    def ask(self, lane: str, dataset: bytes, keys: list) -> Ask:
        """Start asking ``lane`` for the samples of ``keys`` (:meth:`Ask.sample` waits for the answer)."""
        settings = store_module.lane()
        if settings is None:
            return Ask(self, lane, None)
        try:
            fut = client.rpc_async(
                lane,
                lane_get,
                args=(dataset, keys),
                timeout=_PEER_TIMEOUT,
                secret=settings.secret,
                wait_for_worker=False,
                trust_worker=True,  # a peer holds the pool's secret: it could run code here anyway
            )
        except Exception:  # noqa: BLE001 - cannot send: decode here instead
            self.down(lane)
            return Ask(self, lane, None)
        return Ask(self, lane, fut)

    def fetch(self, dataset: bytes, key: Any) -> Any:
        """One sample from the peer that keeps it (following its owner's note), or MISSING."""
        lane = self.source(dataset, key)
        return MISSING if lane is None else self.ask(lane, dataset, [key]).sample(dataset, key)

    def note(self, lane: str, dataset: bytes, keys: list) -> None:
        """Tell the owner at ``lane`` that this worker keeps ``keys`` (not waited for)."""
        settings = store_module.lane()
        if settings is None or self.me is None or not keys:
            return
        try:
            fut = client.rpc_async(
                lane,
                lane_note,
                args=(dataset, keys, self.me),
                timeout=_PEER_TIMEOUT,
                secret=settings.secret,
                wait_for_worker=False,
            )
        except Exception:  # noqa: BLE001 - cannot send: the owner will not know; others decode it
            return
        fut.add_done_callback(_ignore_outcome)


class Ask:
    """A call to a peer lane for some samples, answered while this worker decodes others."""

    def __init__(self, peers: Peers, lane: str, future: Any):
        self.peers, self.lane, self._future = peers, lane, future
        self._answer: dict | None = None

    def sample(self, dataset: bytes, key: Any, follow: bool = True) -> Any:
        """The sample of ``key`` from the answer (waited for), following a note once (when
        ``follow``); or MISSING."""
        if self._answer is None:
            try:
                self._answer = {} if self._future is None else self._future.wait()
            except Exception:  # noqa: BLE001 - a lost or slow peer: decode here instead
                self.peers.down(self.lane)
                self._answer = {}
        x = self._answer.pop(key, MISSING)
        if isinstance(x, store_module.Elsewhere):  # the owner's note: the peer that keeps it
            if not follow or x.lane == self.peers.me or self.peers.is_down(x.lane):
                return MISSING
            return self.peers.ask(x.lane, dataset, [key]).sample(dataset, key, follow=False)
        return x


def _ignore_outcome(fut) -> None:
    try:
        fut.value()
    except Exception:  # noqa: BLE001 - see Peers.note
        pass


class _Batch:
    """What a worker's loading thread knows of the batch it loads: the asks under way, and the
    owners to tell (when the batch ends) which samples it kept."""

    def __init__(self):
        self.asks: dict[Any, Ask] = {}
        self.kept: dict[str, list] = {}


class CachedDataset(Dataset):
    """A map-style cached dataset on a worker: ``self[i] = then(instance[i])``, ``instance[i]`` kept."""

    def __init__(self, shared: Shared, then: Callable | None):
        self.shared = shared
        self.then = then
        self.counts = Counts()
        self.peers = Peers()
        self._batch = threading.local()  # the _Batch being loaded by this thread

    def __len__(self) -> int:
        return len(self.shared.instance)

    @contextlib.contextmanager
    def torchfeed_batch(self, keys) -> Iterator[None]:
        """Around the loading of a batch (the worker's Fetcher enters it): first ask each peer,
        once, for the samples it keeps (the answers arrive while the samples kept or decoded
        here are loaded); at the end, tell the owners which samples this worker kept."""
        batch = _Batch()
        if self.peers.me is not None:
            store, key = store_module.store, self.shared.key
            wanted: dict[str, list] = {}
            for k in keys:
                if store.peek(key, k) is MISSING:
                    lane = self.peers.source(key, k)
                    if lane is not None:
                        wanted.setdefault(lane, []).append(k)
            for lane, ks in wanted.items():
                batch.asks.update(dict.fromkeys(ks, self.peers.ask(lane, key, ks)))
        outer, self._batch.current = getattr(self._batch, "current", None), batch
        try:
            yield
        finally:
            self._batch.current = outer
            for owner, kept in batch.kept.items():
                self.peers.note(owner, self.shared.key, kept)

    def __getitem__(self, index):
        x = self.sample(index)
        return self.then(copy_for_then(x)) if self.then is not None else x

    def sample(self, index) -> Any:
        """The cached (inner) sample of ``index``: kept here, kept by a peer, or decoded (and kept
        here, its owner told)."""
        store, key = store_module.store, self.shared.key
        batch: _Batch | None = getattr(self._batch, "current", None)
        x = store.peek(key, index)
        if x is MISSING:
            if batch is not None:  # asked before the batch, if a peer keeps it
                ask = batch.asks.pop(index, None)
                x = MISSING if ask is None else ask.sample(key, index)
            else:  # outside a batch (no auto-collation): ask now
                x = self.peers.fetch(key, index)
        self.counts.add(x is not MISSING)
        if x is MISSING:
            x = self.shared.instance[index]
            if store.put(key, index, x):
                owner = self.peers.owner(index)
                if owner is not None and batch is not None:
                    batch.kept.setdefault(owner, []).append(index)
                elif owner is not None:
                    self.peers.note(owner, key, [index])
        return x

    def __repr__(self) -> str:
        return f"cached({self.shared.instance!r}, then={self.then!r})"


class _ShardOpener:
    """``open_shard`` of a cached Shards: a shard's decoded samples read once, ``then`` per sample."""

    def __init__(
        self, shared: Shared, open_shard: Callable, then: Callable | None, counts: Counts, peers: Peers
    ):
        self.shared = shared
        self.open_shard = open_shard
        self.then = then
        self.counts = counts
        self.peers = peers

    def __call__(self, url: str):
        store, key, entry = store_module.store, self.shared.key, ("shard", url)
        samples = store.peek(key, entry)
        if samples is MISSING:
            samples = self.peers.fetch(key, entry)
        if samples is not MISSING:
            self.counts.add(True)
            return self._then(samples)
        self.counts.add(False)
        return self._decode(url, entry)

    def _then(self, samples):
        for x in samples:
            yield self.then(copy_for_then(x)) if self.then is not None else x

    def _decode(self, url: str, entry: tuple):
        kept = []
        for x in self.open_shard(url):
            kept.append(x)
            yield self.then(copy_for_then(x)) if self.then is not None else x
        # read to its end: keep it (a stream that stopped early keeps nothing) and tell its owner
        if store_module.store.put(self.shared.key, entry, kept):
            owner = self.peers.owner(entry)
            if owner is not None:
                self.peers.note(owner, self.shared.key, [entry])


_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None))


def copy_for_then(sample: Any, depth: int = 0) -> Any:
    """A copy of a kept sample for ``then`` (tensors cloned, arrays and containers copied,
    other objects deep-copied): what ``then`` does in place stays in its copy."""
    kind = type(sample)
    if kind in _IMMUTABLE:
        return sample
    if isinstance(sample, torch.Tensor) and kind is torch.Tensor:
        return sample.clone()
    if kind is np.ndarray and sample.dtype != object:
        # read-only ones too: torch.from_numpy gives a writable tensor over any array
        return sample.copy()
    if depth < 32:
        if kind in (list, tuple):
            return kind(copy_for_then(v, depth + 1) for v in sample)
        if kind is dict:
            return {k: copy_for_then(v, depth + 1) for k, v in sample.items()}
    return copy.deepcopy(sample)  # anything else (shared parts stay shared within it)


def _cached_shards(shared: Shared, then: Callable | None):
    """A cached iterable dataset: a Shards (or anything with ``open_shard``) with a caching opener."""
    instance = shared.instance
    open_shard = getattr(instance, "open_shard", None)
    if not callable(open_shard):
        raise TypeError(
            f"cached() supports map-style datasets and torchfeed.datasets.Shards; {type(instance).__qualname__} "
            "is an IterableDataset without open_shard: cache its map-style source, or read it through Shards"
        )
    opener = _ShardOpener(shared, open_shard, then, Counts(), Peers())
    instance.open_shard = opener
    instance.torchfeed_cache = opener  # its counts and peers: what set_peers and counts read
    return instance


def _parts(dataset) -> CachedDataset | _ShardOpener:
    """What holds a cached dataset's ``counts`` and ``peers`` (itself, or its shard opener)."""
    if isinstance(dataset, CachedDataset):
        return dataset
    found = getattr(dataset, "torchfeed_cache", None)
    if not isinstance(found, _ShardOpener):
        raise TypeError(f"{type(dataset).__qualname__} is not a cached dataset")
    return found


# -- run on the workers (the lanes themselves: worker/lanes.py) ----------------------------------
def set_peers(dataset, lanes: list[str], me: str | None) -> None:
    """Runs on a worker: the lanes of the workers ``dataset`` is built on, this one's among them."""
    _parts(dataset).peers.set([lane for lane in lanes if lane], me)


def counts(dataset) -> dict[str, int]:
    """Runs on a worker: this dataset's hits and misses here, and the worker's cached bytes."""
    c = _parts(dataset).counts
    figures = store_module.store.figures()
    return {"hits": c.hits, "misses": c.misses, "bytes": figures.bytes, "budget": figures.budget}


# polled during a pass, beside seeded loading, and drawing no random numbers: the worker must
# not hand the global generators back to "outside" code for them
_RNG_FREE: tuple[Any, ...] = (set_peers, counts)
for _fn in _RNG_FREE:
    _fn.manages_rng = True


# -- trainer side -----------------------------------------------------------------------------
def is_cached(factory: Any) -> bool:
    return isinstance(factory, Cached)


def link_peers(session, refs: dict, timeout: float, secret) -> None:
    """Tell every worker holding the dataset the lanes of all of them (after a build)."""
    lanes = client.wait_all(
        {
            w: session.rpc_async(w, lane_address, args=(ref,), timeout=timeout, secret=secret)
            for w, ref in refs.items()
        },
        timeout,
    )
    known = sorted(v for v in lanes.values() if isinstance(v, str))
    client.wait_all(
        {
            w: session.rpc_async(
                w,
                set_peers,
                args=(ref, known, lanes[w] if isinstance(lanes[w], str) else None),
                timeout=timeout,
                secret=secret,
            )
            for w, ref in refs.items()
        },
        timeout,
    )
