"""One authenticated client connection on a worker: its reader and writer threads and the
calls it runs on the worker's executors (see the NOTE in :mod:`torchfeed.worker`).

The connection reaches its server only through public attributes: ``registry`` (remote
references), ``tasks`` (the executors' :class:`~torchfeed.worker.fair.FairQueue`, where
this connection has its own FIFO of ready calls), ``budget`` (what all connections
together hold), ``counters`` (statistics), ``limits``, ``timeout``, ``address`` and
``forget()``.

A call is counted (per connection and in the worker's budget) from its authenticated
header until it is answered, or dropped with its closed connection. Its memory is only
committed as its records arrive: the meta grows record by record (see
:meth:`~torchfeed.protocol.channel.Channel.read_meta`) and the buffers' block is mapped
but untouched (``np.empty``) until records are decrypted into it, so a header announcing
a large call and then stalling costs no memory, only budget.
"""

from __future__ import annotations

import functools
import logging
import pickle
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from .. import seeding
from ..errors import FrameTooLarge, LimitExceeded, ProtocolError
from ..protocol import codec, errordata, serialize, wire
from ..protocol.buffers import allocate, lending
from ..protocol.channel import CHUNK
from ..protocol.limits import check_reply
from ..util import hard_close
from . import counters as workerstats
from .fair import FairQueue
from .objects import Budget, ConnectionLimits, Registry

__all__ = ["ServerConnection"]

log = logging.getLogger("torchfeed.worker")

# replies up to this size are sealed and written by the thread that made them when nothing
# is queued before them (see ServerConnection.send); larger ones always go to the writer
_DIRECT_BYTES = 64 * 1024
_SEALED = -1  # outbox entry: already sealed bytes (the rest of a direct write)
# what one outbox entry counts in unsent_bytes on top of its payload (about its memory): the
# limit on unsent bytes then bounds the entries too, even replies with no payload (PONG)
ENTRY_BYTES = 64


def _describe_exception(exc: BaseException) -> bytes:
    return pickle.dumps(errordata.describe_exception(exc), protocol=5)


class Host(Protocol):
    """What a connection uses of its server (:class:`~torchfeed.worker.WorkerServer`)."""

    address: str
    timeout: float
    limits: ConnectionLimits
    registry: Registry
    tasks: FairQueue
    budget: Budget
    counters: workerstats.Counters

    def forget(self, conn: ServerConnection) -> None: ...


class ServerConnection:
    """One authenticated client connection on the worker (see the NOTE in :mod:`torchfeed.worker`)."""

    _ids = iter(range(1, 1 << 62))

    def __init__(self, server: Host, sock: socket.socket, peer: str, channel):
        self.server = server
        self.sock = sock
        self.peer = peer
        self.id = next(self._ids)
        self.channel = channel
        self.channel.send_stall_timeout = server.timeout
        self.limits: ConnectionLimits = server.limits
        self.cancelled: set = set()
        self.closed = False
        self._cond = threading.Condition()
        self._outbox: deque = deque()
        self.unsent_bytes = 0
        self.queued = 0  # calls received and not yet answered
        self.queued_bytes = 0  # their size
        self.waiting_ids: set = set()  # their request ids (what CANCEL may name)
        self.sending = False  # the writer is inside a send
        self.waiting_for_room = False  # the reader is paused by back pressure
        self.codec = codec.Chooser(CHUNK)  # what this client's replies travel compressed as

    def start(self) -> None:
        """Start the writer, then the reader; if either cannot start (no threads left), close."""
        try:
            threading.Thread(target=self._write_loop, name=f"torchfeed-tx-{self.id}", daemon=True).start()
            threading.Thread(target=self.serve, name=f"torchfeed-rx-{self.id}", daemon=True).start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        with self._cond:
            if self.closed:
                return
            self.closed = True
            self._outbox.clear()
            self.unsent_bytes = 0
            self._cond.notify_all()
        hard_close(self.sock)
        self.channel.close()  # a same-host connection's shared slots
        for _conn, frame, _buffers in self.server.tasks.drop(self):  # calls that will never run
            self._answered(frame)
        self.server.registry.drop_owner(self.id)
        self.server.forget(self)

    # -- writer thread -------------------------------------------------------
    def send(
        self,
        kind: int,
        request_id: int = 0,
        meta: bytes = b"",
        buffers=(),
        flags: int = 0,
        packed=None,
        placed=None,
    ) -> None:
        """Send a message, or queue it for the writer; never blocks (``packed``: its
        buffers compressed, :class:`~torchfeed.protocol.codec.Packed`, sent in their place;
        ``placed``: on a same-host connection, which buffers travel in shared memory).

        A small message with nothing queued before it is sealed and written here, without
        blocking (no hop to the writer thread: the usual case for small replies); what the
        socket does not take at once goes to the front of the outbox for the writer.
        """
        if packed is not None:
            buffers, size = (), len(meta) + packed.wire_bytes
        elif placed is not None:  # the bytes that go through the socket
            size = len(meta) + sum(
                v.nbytes for v in placed.inline([memoryview(b).cast("B") for b in buffers])
            )
        else:
            size = len(meta) + sum(memoryview(b).nbytes for b in buffers)
        with self._cond:
            if self.closed:
                return
            if (
                self._outbox
                or self.sending
                or size > _DIRECT_BYTES
                or packed is not None
                or placed is not None
            ):
                # an entry is charged its overhead too: empty replies (PONG) are bounded as well
                self._outbox.append(
                    (kind, request_id, meta, buffers, flags, size + ENTRY_BYTES, packed, placed)
                )
                self.unsent_bytes += size + ENTRY_BYTES
                self._cond.notify_all()
                return
            self.sending = True  # the writer keeps out until the rest, if any, is queued
        rest: memoryview | None = None
        try:
            rest = self.channel.write_nowait(self.channel.seal(kind, request_id, meta, buffers, flags))
        except OSError as exc:
            if not self.closed:
                log.info("could not write to client %s: %s", self.peer, exc)
            self.close()
        finally:
            with self._cond:
                self.sending = False
                if rest is not None and len(rest) and not self.closed:
                    self._outbox.appendleft((_SEALED, 0, rest, (), 0, len(rest) + ENTRY_BYTES, None, None))
                    self.unsent_bytes += len(rest) + ENTRY_BYTES
                if self._outbox:  # queued meanwhile: the writer waited for us
                    self._cond.notify_all()

    def _write_loop(self) -> None:
        self._until_lost(
            self._write_replies, "could not write to client %s: %s", "unexpected error writing to %s"
        )

    def _write_replies(self) -> None:
        while True:
            with self._cond:
                while (not self._outbox or self.sending) and not self.closed:
                    self._cond.wait()
                if self.closed:
                    return
                kind, rid, meta, buffers, flags, size, packed, placed = self._outbox.popleft()
                self.sending = True
            if kind == _SEALED:  # the rest of a message send() began to write
                self.channel.write(meta)
            elif placed is not None:
                self.channel.send(kind, rid, meta, buffers, flags, placed=placed)
            else:
                self.channel.send(kind, rid, meta, buffers, flags, packed=packed)
            del meta, buffers, packed, placed
            with self._cond:
                self.sending = False
                self.unsent_bytes -= size
                self._cond.notify_all()

    def busy(self) -> bool:
        """Replies waiting or being sent, or reading paused for them: judged by the writer."""
        return bool(self._outbox) or self.sending or self.waiting_for_room

    def silent_for(self, now: float) -> float:
        return now - self.channel.last_activity

    # -- reader thread -----------------------------------------------------
    def serve(self) -> None:
        self._until_lost(
            self._read_loop, "client %s disconnected: %s", "unexpected error serving %s", (ProtocolError,)
        )

    def _until_lost(
        self, loop: Callable[[], None], lost: str, bug: str, dropped: tuple[type[Exception], ...] = ()
    ) -> None:
        """Run the reader's or the writer's ``loop``, then close the connection. A socket error
        (``lost``, logged unless closed already) or a client breaking the rules (``dropped``)
        ends it; any other exception is a bug (``bug``), and it costs this connection, never the
        worker."""
        try:
            loop()
        except OSError as exc:  # ConnectionError and TimeoutError included
            if not self.closed:
                log.info(lost, self.peer, exc)
        except dropped as exc:
            log.warning("dropping client %s: %s", self.peer, exc)
        except Exception:
            log.exception(bug, self.peer)
        finally:
            self.close()

    def _read_loop(self) -> None:
        channel = self.channel
        frame_limits = self.limits.frame_limits()
        while not self.closed:
            self._wait_for_room()
            try:
                frame = channel.read_header(frame_limits)
            except FrameTooLarge as exc:  # authentic but too big: answer it, keep the connection
                if exc.frame is None:  # not read far enough to be skipped
                    raise
                self._refuse(exc.frame.request_id, exc)  # answered at once, then read past
                channel.skip(exc.frame)
                continue
            kind = frame.kind
            if kind in (wire.CALL, wire.CALL_REF):
                refusal = self._over_limits(frame) or self.server.budget.take(frame.size)
                if refusal is not None:
                    self._refuse(frame.request_id, refusal)
                    channel.skip(frame)
                    continue
                try:  # memory is committed as records arrive (see the module docstring)
                    channel.read_meta(frame)
                    buffers = allocate(frame.buffer_lengths) if frame.buffer_lengths else []
                    channel.read_buffers(buffers, frame, self.peer)
                except BaseException:
                    self.server.budget.give(frame.size)
                    raise
                with self._cond:
                    self.queued += 1
                    self.queued_bytes += frame.size
                    self.waiting_ids.add(frame.request_id)
                if not self.server.tasks.put(self, (self, frame, buffers)):  # the worker is stopping
                    self._answered(frame)
                del buffers  # the task owns them now
                continue
            channel.read_meta(frame)
            channel.skip(frame, meta=False)
            if kind == wire.PING:
                self.send(wire.PONG, frame.request_id)
            elif kind == wire.RELEASE:
                self.server.registry.release(pickle.loads(frame.meta), self.id)
            elif kind == wire.CANCEL:
                with self._cond:  # only requests still waiting can be skipped
                    self.cancelled.update(rid for rid in pickle.loads(frame.meta) if rid in self.waiting_ids)
            elif kind == wire.STATS:  # [stats hook] from counters only; send() never blocks
                self.send(wire.REPLY, frame.request_id, workerstats.reply(self.server))
            else:
                raise ProtocolError(f"a client may not send {wire.KIND_NAMES[kind]} messages")

    def _over_limits(self, frame: wire.Frame) -> LimitExceeded | None:
        lim = self.limits
        if frame.size > lim.max_call_bytes:
            return LimitExceeded(
                f"a call of {frame.size:,} bytes (pickled arguments plus buffers) exceeds the worker's limit of "
                f"{lim.max_call_bytes:,}: pass less data per call (build large objects inside the dataset on "
                "the worker) or start the worker with a larger --max-call-bytes"
            )
        if self.queued >= lim.max_queued_requests or self.queued_bytes + frame.size > lim.max_queued_bytes:
            return LimitExceeded(
                f"this client has {self.queued} requests ({self.queued_bytes:,} bytes) waiting on the worker (the "
                f"limits are {lim.max_queued_requests} requests and {lim.max_queued_bytes:,} bytes): wait for "
                "replies before sending more, or start the worker with a larger --max-queued-requests"
            )
        return None

    def _wait_for_room(self) -> None:
        """Back pressure: stop reading while too many reply bytes wait to be sent."""
        with self._cond:
            self.waiting_for_room = True
            while self.unsent_bytes > self.limits.max_unsent_bytes and not self.closed:
                self._cond.wait(1.0)
            self.waiting_for_room = False

    def _refuse(self, rid: int, exc: BaseException) -> None:
        log.info("refused a request from %s: %s", self.peer, exc)
        self.server.counters.refused()  # [stats hook]
        self.send(wire.ERROR, rid, _describe_exception(exc))

    # -- executor threads ----------------------------------------------------
    def execute(self, frame: wire.Frame, buffers) -> None:
        reply = None
        try:
            reply = self._execute(frame, buffers)
        finally:
            # the call's share of the limits is free before its reply leaves: a client that
            # has the reply finds the room it took
            self._answered(frame)
        if reply is not None:
            reply()

    def _execute(self, frame: wire.Frame, buffers) -> Callable[[], None] | None:
        """Run the call; what sends its reply (None: nobody waits for one)."""
        rid = frame.request_id
        if rid in self.cancelled or self.closed:  # nobody waits for it (queued as its connection closed)
            self.cancelled.discard(rid)
            return None
        try:
            payload = serialize.loads_call(frame.meta, buffers, self.server.registry)
            if frame.kind == wire.CALL:
                func, args, kwargs = payload
            else:
                ref_id, args, kwargs = payload
                func = self.server.registry.get(ref_id, self.server.address)
            if not getattr(func, "manages_rng", False):
                seeding.restore_outside()  # seeded loading may have left its seeds behind
            # a same-host trainer's batches are stacked straight into the slots it maps
            arena = self.channel.arena if self.channel.local else None
            with lending(arena) as fresh:
                result = func(*(args or ()), **(kwargs or {}))
            flags = frame.flags & wire.FLAG_RREF
            out: list[memoryview]
            packed = placed = None
            if flags:
                ref = self.server.registry.put(result, self.id, self.limits.max_refs)
                meta, out = pickle.dumps(ref), []
            else:
                meta, out = serialize.dumps_reply(result)
                check_reply(meta, out, getattr(func, "reply_limits", None))
                mode = (frame.flags & wire.FLAG_CODEC) >> wire.FLAG_CODEC_SHIFT
                if arena is not None and out:  # in shared memory: the batch just collated as it lies
                    placed = arena.place([memoryview(b).cast("B") for b in out], fresh)
                elif mode and out:  # compress, then seal (the writer seals it)
                    packed = self.codec.pack(out, mode, codec.rate_of_hint(frame.aux))
            del result
        except BaseException as exc:  # user code may raise anything, SystemExit and Ctrl-C included
            return functools.partial(self._reply, wire.ERROR, rid, _describe_exception(exc), [])
        return functools.partial(self._reply, wire.REPLY, rid, meta, out, flags, packed, placed)

    def _reply(
        self, kind: int, rid: int, meta: bytes, buffers, flags: int = 0, packed=None, placed=None
    ) -> None:
        self.cancelled.discard(rid)
        wire_bytes = packed.wire_bytes if packed is not None else None
        self.server.counters.replied(kind, meta, buffers, wire_bytes)  # [stats hook]
        self.send(kind, rid, meta, buffers, flags, packed, placed)

    def _answered(self, frame: wire.Frame) -> None:
        with self._cond:
            self.queued -= 1
            self.queued_bytes -= frame.size
            self.waiting_ids.discard(frame.request_id)
            self.cancelled.discard(frame.request_id)
        self.server.budget.give(frame.size)
