"""Handles of the data plane's client: a remote object (:class:`RemoteRef`) and a request
in flight (:class:`Call`). Both are made by :mod:`torchfeed.client` and its sessions."""

from __future__ import annotations

import pickle
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypedDict

from ..errors import WorkerLost
from ..protocol import codec, serialize, wire
from ..protocol.replies import ReplyPolicy

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11 (torch requires typing_extensions)

    from .connection import Connection

Callback = Callable[[bool, Any], None]


class RequestOptions(TypedDict, total=False):
    """The keywords of :meth:`RemoteRef.request` that :meth:`RemoteRef.call` passes on."""

    pin: bool
    policy: ReplyPolicy | None
    compression: int | None


class Call:
    """One request in flight on a connection: :meth:`cancel` it, or read its ``request_id``."""

    __slots__ = ("conn", "request_id")

    def __init__(self, conn: Connection, request_id: int):
        self.conn = conn
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"Call({self.conn.address}, id={self.request_id})"

    def cancel(self) -> None:
        """Forget this request: its callback is not called (unless it is being called at this
        moment, on the reader thread); the worker skips the request if it has not started."""
        self.conn.cancel([self.request_id])


class RemoteRef:
    """A reference to an object kept on a worker (``rpc_async(..., rref=True)``).

    Pass it as an argument of later calls to the same worker: it arrives there as the
    object itself. The worker frees the object when this reference is garbage collected
    or when the client disconnects.
    """

    def __init__(self, conn: Connection, ref_id: int):
        self.address = conn.address
        self.ref_id = ref_id
        self._conn = conn
        self._session = conn.session  # a reference keeps its session, so its connection, open
        self._finalizer = weakref.finalize(self, conn.release_later, ref_id)

    def __reduce__(self):
        # a reference is valid only on its own connection: once that is gone, no worker holds
        # the object (a new connection to the same worker would be refused it)
        if self._conn.closed:
            raise WorkerLost(f"{self!r} was lost with its connection to worker {self.address}")
        return serialize.resolve_reference, (self.ref_id, self.address)

    def __repr__(self) -> str:
        return f"RemoteRef({self.address}, id={self.ref_id})"

    def release(self) -> None:
        """Free the remote object now."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether the connection this reference lives on has failed or was closed."""
        return self._conn.closed

    @property
    def alive(self) -> bool:
        """Whether calls through this reference can still reach the object (not :attr:`closed`)."""
        return not self._conn.closed

    def call(self, args: tuple, *, callback: Callback, **options: Unpack[RequestOptions]) -> Call:
        """Call the referenced object with ``args`` (plain pickle); ``callback(ok, value)`` gets
        the outcome on the connection's reader thread. Returns the :class:`Call` (cancellable).
        ``options`` are :meth:`request`'s."""
        return Call(self._conn, self.request(args, callback=callback, **options))

    def request(
        self,
        args: tuple,
        *,
        callback: Callback,
        pin: bool = False,
        policy: ReplyPolicy | None = None,
        compression: int | None = None,
    ) -> int:
        """As :meth:`call`, returning the bare request id (to cancel many at once with :meth:`cancel`).
        ``policy`` says how the result is loaded (default: the session's); ``compression`` (a
        :data:`torchfeed.protocol.codec.MODES` value; default: the session's) how its buffers may
        travel; ``pin`` puts its tensors in pinned memory."""
        meta = pickle.dumps((self.ref_id, args, None), protocol=5)
        if compression is None:
            owner = self._conn.session
            compression = getattr(owner, "compression", codec.NONE) if owner is not None else codec.NONE
        return self._conn.request(
            wire.CALL_REF, meta, callback=callback, pin=pin, policy=policy, compression=compression
        )

    def cancel(self, request_ids: Iterable[int]) -> None:
        """Forget these requests (ids from :meth:`request`), in one message to the worker."""
        self._conn.cancel(request_ids)
