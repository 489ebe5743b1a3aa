"""Exception hierarchy: every error torchfeed raises derives from TorchfeedError."""

from __future__ import annotations

from typing import Optional, Sequence


class TorchfeedError(Exception):
    """Root of all torchfeed errors."""


class AuthenticationError(TorchfeedError):
    """The peer could not prove it holds the shared secret (or we could not)."""


class ProtocolError(TorchfeedError):
    """The peer sent bytes that do not follow the torchfeed wire protocol."""


class FrameTooLarge(ProtocolError):
    """A length read from the wire exceeds the configured limit."""


class WorkerLost(TorchfeedError):
    """A worker (or all workers) became unreachable.

    ``errors`` maps each lost worker address to the last error seen for it.
    """

    def __init__(self, message: str, errors: Optional[dict] = None):
        super().__init__(message)
        self.errors = dict(errors or {})


class PoisonSampleError(TorchfeedError):
    """Loading these samples killed worker processes again and again.

    ``indices`` are the sample indices of the batch; ``workers`` the workers it killed.
    """

    def __init__(self, message: str, indices=None, workers=None):
        super().__init__(message)
        self.indices = list(indices or [])
        self.workers = list(workers or [])


class Timeout(TorchfeedError, TimeoutError):
    """An operation did not finish within its timeout."""


class RemoteError(TorchfeedError):
    """An exception raised by user code on a worker.

    Attributes
    ----------
    address : str
        ``host:port`` of the worker where the exception happened.
    remote_type : str
        Fully qualified name of the remote exception type.
    remote_message : str
        ``str()`` of the remote exception.
    remote_traceback : str
        The formatted traceback text, as printed on the worker.
    indices : list or None
        For data loading: the sample indices of the failed batch.
    """

    def __init__(
        self,
        address: str,
        remote_type: str,
        remote_message: str,
        remote_traceback: str,
        indices: Optional[Sequence[int]] = None,
    ):
        self.address = address
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.indices = list(indices) if indices is not None else None
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"on worker {self.address}"
        if self.indices is not None:
            shown = self.indices[:16]
            more = "" if len(self.indices) <= 16 else f" ... ({len(self.indices)} in all)"
            where += f" while loading sample indices {shown}{more}"
        return (
            f"{self.remote_type}: {self.remote_message}\n"
            f"  raised {where}\n"
            f"--- remote traceback ---\n{self.remote_traceback.rstrip()}"
        )

    def with_indices(self, indices: Sequence[int]) -> "RemoteError":
        return RemoteError(
            self.address, self.remote_type, self.remote_message, self.remote_traceback, indices
        )

    def __reduce__(self):
        return (
            RemoteError,
            (self.address, self.remote_type, self.remote_message, self.remote_traceback, self.indices),
        )


class LimitExceeded(TorchfeedError):
    """A request went over a per-connection bound of the worker (see the message for the knob)."""
