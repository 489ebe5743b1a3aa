"""Worker side: the context torch's ``get_worker_info()`` reports while a loader's code runs.

On a torchfeed worker, ``torch.utils.data.get_worker_info()`` called from ``__getitem__``,
``__iter__``, a collate function or ``worker_init_fn`` returns a ``WorkerInfo`` whose
``id`` is the worker's index in the dataset's worker list, ``num_workers`` the length of
that list, ``seed`` the worker's seed for the pass (``base_seed + id``, as in torch) and
``dataset`` the dataset instance that loads. Outside of a loader's calls it returns
``None``, as in torch's main process.

One worker process serves many loaders, possibly on several threads at once
(``--parallel``), so the context is per thread. torch's ``get_worker_info`` reads a
module global; :func:`install` makes that one function consult this module first (and
torch's own global next, so DataLoader worker processes forked from a worker still see
theirs).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.utils.data
from torch.utils.data._utils import worker as torch_worker  # where torch keeps get_worker_info's state

from .. import seeding

_local = threading.local()
_install_lock = threading.Lock()
_installed = False

# The body torch's get_worker_info gets: no globals of torch's module are needed.
_REPLACEMENT = "def get_worker_info():\n    return __import__('torchfeed.worker.context', fromlist=['current']).current()\n"


def current() -> Any | None:
    """This thread's worker context, else torch's own (None outside of loading)."""
    info = getattr(_local, "info", None)
    if info is not None:
        return info
    return getattr(torch_worker, "_worker_info", None)


def install() -> None:
    """Make ``torch.utils.data.get_worker_info`` report this thread's context (once per process)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        namespace: dict = {}
        exec(compile(_REPLACEMENT, "<torchfeed.worker.context>", "exec"), namespace)  # noqa: S102 - fixed text
        replacement = namespace["get_worker_info"].__code__
        for target in {torch_worker.get_worker_info, torch.utils.data.get_worker_info}:
            if target.__code__.co_freevars:
                raise RuntimeError("this torch's get_worker_info cannot report torchfeed's worker context")
            target.__code__ = replacement
        _installed = True


@contextlib.contextmanager
def worker_context(info: Any) -> Iterator[None]:
    """Run the block with ``get_worker_info()`` returning ``info`` on this thread."""
    install()
    previous = getattr(_local, "info", None)
    _local.info = info
    try:
        yield
    finally:
        _local.info = previous


def make_info(worker_id: int, num_workers: int, seed: int, dataset: Any) -> Any:
    """A torch ``WorkerInfo`` (read-only attributes, as torch's)."""
    return torch_worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)


def own_copy(dataset: Any) -> Any:
    """A shallow copy whose attributes can be rebound without touching ``dataset``.

    ``worker_init_fn`` configures ``get_worker_info().dataset`` (``dataset.start = ...``);
    in torch every worker process has a copy of its own. Made without ``__getstate__``
    (which may drop what only pickling should drop); an object that cannot be copied
    this way is used as it is.
    """
    cls: Any = type(dataset)
    try:
        copy = cls.__new__(cls)
        if hasattr(dataset, "__dict__"):
            copy.__dict__.update(dataset.__dict__)
        for klass in cls.__mro__:
            for slot in getattr(klass, "__slots__", ()):
                if slot not in ("__dict__", "__weakref__") and hasattr(dataset, slot):
                    setattr(copy, slot, getattr(dataset, slot))
    except Exception:
        return dataset
    return copy


@dataclass
class PassContext:
    """What a worker knows about one loader pass: its context and its generator stream."""

    pass_id: int
    info: Any
    dataset: Any
    stream: seeding.Stream


class WorkerSetup:
    """Per-pass setup of one loader on one worker, as torch sets up a worker process.

    At the first call of a pass: the dataset that loads (the worker's instance, or with
    ``worker_init_fn`` a copy of it), the generators seeded as torch seeds worker ``id``
    (``base_seed + id``), then ``worker_init_fn(id)``, all under the worker context. With
    ``persistent`` (torch's ``persistent_workers``) that happens once: later passes keep
    the dataset copy and the generators' stream. Thread-safe: concurrent calls of one
    pass set it up once.
    """

    def __init__(self, dataset: Any, worker_init_fn: Callable | None = None, persistent: bool = False):
        self.dataset = dataset
        self.worker_init_fn = worker_init_fn
        self.persistent = persistent
        self._lock = threading.Lock()
        self._pass: PassContext | None = None
        self._initialized: Any | None = None  # the copy worker_init_fn ran on (persistent)

    def enter(self, pass_id: int, worker_id: int, num_workers: int, base_seed: int) -> PassContext:
        with self._lock:
            done = self._pass
            if done is not None and done.pass_id == pass_id:
                return done
            if (
                self.persistent
                and done is not None
                and done.info.id == worker_id
                and done.info.num_workers == num_workers
            ):
                # torch's persistent workers keep their dataset and generators between passes
                self._pass = PassContext(pass_id, done.info, done.dataset, done.stream)
                return self._pass
            dataset = self._dataset_for_pass()
            seed = (base_seed & seeding.INT63) + worker_id
            info = make_info(worker_id, num_workers, seed, dataset)
            stream = seeding.Stream()
            with worker_context(info):
                seeding.use(stream)
                seeding.seed_like_torch(base_seed & seeding.INT63, worker_id)
                if self.worker_init_fn is not None and (not self.persistent or self._initialized is None):
                    self.worker_init_fn(worker_id)  # an exception leaves the pass not set up: retried
                    self._initialized = dataset
            self._pass = PassContext(pass_id, info, dataset, stream)
            return self._pass

    def _dataset_for_pass(self) -> Any:
        if self.worker_init_fn is None:
            return self.dataset
        if self.persistent and self._initialized is not None:
            return self._initialized
        return own_copy(self.dataset)
