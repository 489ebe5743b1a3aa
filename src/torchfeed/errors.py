"""Exception hierarchy: every error torchfeed raises derives from TorchfeedError.

An exception raised by user code on a worker comes back as :class:`RemoteError`; where
its type can be rebuilt in the trainer it is also an instance of that type (see
:func:`rebuild_remote_error`), so ``except KeyError:`` catches a remote ``KeyError`` as it
catches one raised by torch's DataLoader workers.
"""

from __future__ import annotations

import pickle
import re
import traceback
from collections.abc import Sequence
from typing import Any

from . import tracebacks

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
        _set_remote_fields(self, address, remote_type, remote_message, remote_traceback, indices)
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


class LimitExceeded(TorchfeedError):
    """A request went over a per-connection bound of the worker (see the message for the knob)."""


def _set_remote_fields(exc, address, remote_type, remote_message, remote_traceback, indices) -> None:
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


# -- rebuilding a remote exception's type in the trainer -----------------------------------


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """Worker side: what the trainer needs to re-raise ``exc`` (a dict of plain data and pickles).

    ``type``, ``message`` and ``traceback`` are always there; ``cls`` (the type, pickled by
    reference or by value) and ``reduced`` (its constructor arguments and state) when they
    can be pickled; ``template``, ``frames`` and ``marker``, the traceback taken apart,
    let the trainer show its own source for frames of code it sent (tracebacks.py).
    """
    etype = type(exc)
    name = (
        etype.__qualname__ if etype.__module__ == "builtins" else f"{etype.__module__}.{etype.__qualname__}"
    )
    try:
        message = str(exc)
    except Exception:  # a broken __str__ (or __repr__) must not break error reporting
        try:
            message = repr(exc)
        except Exception:
            message = object.__repr__(exc)
    info: dict[str, Any] = {"type": name, "message": message}
    try:
        info.update(tracebacks.describe(exc))
    except Exception:
        try:
            info["traceback"] = "".join(traceback.format_exception(etype, exc, exc.__traceback__))
        except Exception:
            info["traceback"] = f"{name}: {message}\n(the traceback could not be formatted)"
    import cloudpickle  # by value: exception classes defined in __main__ or in functions

    try:
        info["cls"] = cloudpickle.dumps(etype)
    except Exception:
        return info
    try:
        reduced = exc.__reduce__()
        ctor_args = tuple(reduced[1]) if len(reduced) > 1 else ()
        state = reduced[2] if len(reduced) > 2 else None
    except Exception:
        ctor_args, state = tuple(getattr(exc, "args", ())), None
    for candidate in ((ctor_args, state), (ctor_args, None), ((message,), None)):
        try:
            reduced = cloudpickle.dumps(candidate)
        except Exception:
            continue
        if len(reduced) <= _MAX_REDUCED or candidate[1] is None and candidate[0] == (message,):
            info["reduced"] = reduced
            break
    return info


_MAX_REDUCED = 1 << 20  # an exception carrying more data than this comes back with its message only


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


def rebuild_remote_error(
    address: str, info: dict[str, Any], indices: Sequence[Any] | None = None
) -> RemoteError:
    """Trainer side: the exception to raise for a worker's :func:`describe_exception` dict.

    Its ``remote_traceback`` shows frames of code this process sent by value with this
    process's source (see :func:`torchfeed.tracebacks.render`).
    """
    fields = (address, info["type"], info["message"], tracebacks.render(info), indices)
    etype = _loads(info.get("cls"))
    made = remote_type_for(etype) if etype is not None else None
    if made is None or made is etype:
        return RemoteError(*fields)
    reduced = _loads(info.get("reduced")) or ((info["message"],), None)
    exc = _instantiate(made, etype, *reduced)
    if exc is None:
        return RemoteError(*fields)
    _set_remote_fields(exc, *fields)
    exc.remote_class = etype
    return exc


def _loads(raw: bytes | None):
    if raw is None:
        return None
    try:
        return pickle.loads(raw)
    except Exception:  # the type's module is not importable here, or the pickle is stale
        return None


def _instantiate(made: type[RemoteError], etype: type, ctor_args: tuple, state) -> RemoteError | None:
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
            try:
                setattr(exc, key, value)
            except Exception:
                pass
    return exc


def _reduce_rebuilt(self):
    info = {"type": self.remote_type, "message": self.remote_message, "traceback": self.remote_traceback}
    try:
        info["cls"] = pickle.dumps(self.remote_class)
        state = {k: v for k, v in self.__dict__.items() if k not in _OWN_FIELDS}
        info["reduced"] = pickle.dumps((tuple(self.args), state))
    except Exception:
        info.pop("cls", None)
    return rebuild_remote_error, (self.address, info, self.indices)


_OWN_FIELDS = frozenset(
    {"address", "remote_type", "remote_message", "remote_traceback", "indices", "remote_class"}
)
