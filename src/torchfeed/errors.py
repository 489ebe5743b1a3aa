"""Exception hierarchy: every error torchfeed raises derives from TorchfeedError.

An exception raised by user code on a worker comes back as :class:`RemoteError`; where
its type can be rebuilt in the trainer it is also an instance of that type (see
:func:`rebuild_remote_error`), so ``except KeyError:`` catches a remote ``KeyError`` as it
catches one raised by torch's DataLoader workers.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Sequence
from typing import Any

# This module is imported by the command line before torch: keep it free of heavy imports.


class TorchfeedError(Exception):
    """Root of all torchfeed errors."""


class AuthenticationError(TorchfeedError):
    """The peer could not prove it holds the shared secret (or we could not)."""


class ProtocolError(TorchfeedError):
    """The peer sent bytes that do not follow the torchfeed wire protocol."""


class FrameTooLarge(ProtocolError):
    """A message is larger than a configured limit (or than the wire format can carry)."""

    # the frame's header, when it was authentic and read: its rest can be skipped and the
    # connection kept (set by the sealed channel)
    frame: Any = None  # a torchfeed.protocol.wire.Frame (errors sits below the protocol)


class SerializationError(TorchfeedError, pickle.PicklingError, TypeError):
    """Something could not be pickled to be sent (or unpickled after it was received)."""


class WorkerLost(TorchfeedError):
    """A worker (or all workers) became unreachable.

    ``errors`` maps each lost worker address to the last error seen for it.
    """

    def __init__(self, message: str, errors: dict | None = None):
        super().__init__(message)
        self.errors = dict(errors or {})


class ConnectionClosed(WorkerLost):
    """This process closed the connection itself (shutdown, ``LocalWorkers.close()``).

    Not a failure of the worker: loaders do not warn about it.
    """


def worker_lost(address: str, cause: BaseException | None) -> WorkerLost:
    """The error that requests pending on a failed connection to ``address`` receive."""
    kind = ConnectionClosed if isinstance(cause, ConnectionClosed) else WorkerLost
    return kind(f"worker {address} was lost: {cause!r}", {address: repr(cause)})


class PoisonSampleError(TorchfeedError):
    """Loading these samples killed worker processes again and again.

    ``indices`` are the sample indices of the batch; ``workers`` the workers it killed.
    """

    def __init__(self, message: str, indices=None, workers=None):
        super().__init__(message)
        self.indices = list(indices or [])
        self.workers = list(workers or [])


class Timeout(TorchfeedError, TimeoutError, RuntimeError):
    """An operation did not finish within its timeout.

    Also a ``RuntimeError``, the type torch's DataLoader raises when ``timeout`` expires.
    """


_MODULE_HINT = re.compile(r"No module named '([^']+)'")


class RemoteError(TorchfeedError):
    """An exception raised by user code on a worker.

    When the remote exception's type can be rebuilt in the trainer, the exception raised
    is an instance of both that type and ``RemoteError`` (see :func:`rebuild_remote_error`).

    Attributes
    ----------
    address : str
        ``host:port`` of the worker where the exception happened.
    remote_type : str
        Fully qualified name of the remote exception type.
    remote_message : str
        ``str()`` of the remote exception.
    remote_traceback : str
        The formatted traceback text, as printed on the worker, except that frames of code
        the trainer sent by value (functions and classes of ``__main__``, of notebooks or
        defined inside functions) show the trainer's file and source line.
    indices : list or None
        For data loading: the sample indices of the failed batch.
    """

    address: str
    remote_type: str
    remote_message: str
    remote_traceback: str
    indices: list[Any] | None
    remote_class: type  # rebuilt types only: the remote exception's own type

    def __init__(
        self,
        address: str,
        remote_type: str,
        remote_message: str,
        remote_traceback: str,
        indices: Sequence[Any] | None = None,
    ):
        set_remote_fields(self, address, remote_type, remote_message, remote_traceback, indices)
        super().__init__(self._render())

    def __str__(self) -> str:
        return self._render()

    def _render(self) -> str:
        where = f"on worker {self.address}"
        if self.indices is not None:
            shown = self.indices[:16]
            more = "" if len(self.indices) <= 16 else f" ... ({len(self.indices)} in all)"
            where += f" while loading sample indices {shown}{more}"
        text = (
            f"{self.remote_type}: {self.remote_message}\n"
            f"  raised {where}\n"
            f"--- remote traceback ---\n{self.remote_traceback.rstrip()}"
        )
        return text + _hint(self)

    def with_indices(self, indices: Sequence[Any]) -> RemoteError:
        """Record the sample indices of the batch that failed; returns this exception."""
        self.indices = list(indices)
        return self

    def __reduce__(self):
        return (
            RemoteError,
            (self.address, self.remote_type, self.remote_message, self.remote_traceback, self.indices),
        )


class UnsafeReplyError(SerializationError):
    """A worker's reply names a class or function the trainer does not load by default.

    ``global_name`` is its ``module.name`` (the first one the reply needs), ``global_names``
    every one the reply needs and the trainer does not load; allow a type of yours with
    :func:`torchfeed.add_safe_globals` (see the message).
    """

    global_name: str = ""
    global_names: list[str] = []  # noqa: RUF012  # replaced per instance, never changed in place


class LimitExceeded(TorchfeedError):
    """A request went over a per-connection bound of the worker (see the message for the knob)."""


def set_remote_fields(exc, address, remote_type, remote_message, remote_traceback, indices) -> None:
    """Fill in the :class:`RemoteError` attributes of ``exc``."""
    exc.address = address
    exc.remote_type = remote_type
    exc.remote_message = remote_message
    exc.remote_traceback = remote_traceback
    exc.indices = list(indices) if indices is not None else None


def _hint(exc: RemoteError) -> str:
    if exc.remote_type not in ("ModuleNotFoundError", "ImportError"):
        return ""
    found = _MODULE_HINT.search(exc.remote_message)
    if not found:
        return ""
    return (
        f"\nHint: module {found.group(1)!r} cannot be imported on worker {exc.address}. Install it in the "
        "worker's environment (for your own code: `pip install -e .` of your project there), or put its "
        "directory on the worker's PYTHONPATH (`PYTHONPATH=/path/to/code torchfeed worker ...`); "
        "torchfeed.LocalWorkers gives its workers this process's sys.path. Classes and functions defined "
        "in __main__ or inside functions are sent by value and need nothing on the worker."
    )


# -- rebuilding a remote exception's type in the trainer (the data: protocol/errordata.py) ----

_remote_types: dict[type, type[RemoteError]] = {}


def remote_type_for(etype: type) -> type[RemoteError] | None:
    """A class that is both ``etype`` and :class:`RemoteError` (None if none can be made)."""
    if not (isinstance(etype, type) and issubclass(etype, Exception)):
        return None  # KeyboardInterrupt, SystemExit... on a worker are not re-raised as such
    if issubclass(etype, (StopIteration, StopAsyncIteration)):
        return None  # raised from a loader's __next__ it would silently end the epoch
    if issubclass(etype, RemoteError):
        return etype
    made: type[RemoteError] | None = _remote_types.get(etype)
    if made is None:
        try:
            made = type(
                f"RemoteError[{etype.__qualname__}]",
                (RemoteError, etype),
                {
                    "__module__": __name__,
                    "__reduce__": _reduce_rebuilt,
                    "__doc__": f"A {etype.__qualname__} raised on a worker (also a RemoteError).",
                },
            )
        except TypeError:  # incompatible layout or a final class
            return None
        _remote_types[etype] = made
    return made


def instantiate(made: type[RemoteError], etype: type, ctor_args: tuple, state) -> RemoteError | None:
    """An instance of ``made`` (from :func:`remote_type_for`) built as ``etype`` builds one."""
    try:
        exc = made.__new__(made, *ctor_args)
    except Exception:
        return None
    try:
        etype.__init__(exc, *ctor_args)  # type: ignore[misc]  # exc is an etype: made subclasses it
    except Exception:  # e.g. an __init__ with other parameters than its args: keep the args
        exc.args = tuple(ctor_args)
    if isinstance(state, dict):
        for key, value in state.items():
            if not _settable(made, key):
                continue
            try:
                setattr(exc, key, value)
            except Exception:
                pass
    return exc


def _settable(made: type, key: Any) -> bool:
    """Whether a remote exception's attribute ``key`` may be set on its rebuilt instance: never
    one of RemoteError's fields or methods (the loader calls ``with_indices``), a special
    name, what the class defines as a method or descriptor, or an attribute of torchfeed's
    own classes (a plain class default of the user's, such as ``code = 0``, may be overridden)."""
    if not isinstance(key, str) or key.startswith("__") or key in _OWN_FIELDS or hasattr(RemoteError, key):
        return False
    for klass in made.__mro__:
        if key in vars(klass):
            if klass.__module__ == __name__:  # torchfeed's (FrameTooLarge.frame): never a worker's
                return False
            default = vars(klass)[key]
            return not (callable(default) or hasattr(default, "__get__") or hasattr(default, "__set__"))
    return not hasattr(made, key)  # (a name only a metaclass answers)


def _reduce_rebuilt(self):
    # pickled in this process (multiprocessing, a cache): its type by reference, as pickle does
    state = {k: v for k, v in self.__dict__.items() if k not in _OWN_FIELDS}
    fields = (self.address, self.remote_type, self.remote_message, self.remote_traceback, self.indices)
    return _remake, (self.remote_class, fields, tuple(self.args), state)


def _remake(etype: type, fields: tuple, args: tuple, state: dict) -> RemoteError:
    made = remote_type_for(etype)
    exc = instantiate(made, etype, args, state) if made is not None and made is not etype else None
    if exc is None:
        return RemoteError(*fields)
    set_remote_fields(exc, *fields)
    exc.remote_class = etype
    return exc


_OWN_FIELDS = frozenset(
    {"address", "remote_type", "remote_message", "remote_traceback", "indices", "remote_class"}
)
