"""The message layer of a same-host connection: the records of :mod:`.channel`, unsealed,
with large reply buffers in shared memory.

Why no encryption: the connection is a Unix socket whose peer runs under this process's
own uid, as the kernel attests (:mod:`torchfeed.protocol.localpath`). Its bytes never leave
the kernel, and no other user can read or inject into them; a process of the same user
could read either side's memory anyway. The handshake before it still proves both sides
hold the same secret, so a trainer never talks to another job's worker by mistake.

Layout: as a sealed message without tags. A reply with ``wire.FLAG_SHM`` carries, after its
buffer-length table, the table of :func:`torchfeed.protocol.shm.parse_table`; the buffers
placed in slots do not travel, the others follow the meta as usual. The descriptors of new
slots travel with the message's first bytes (``SCM_RIGHTS``); the reader collects every
descriptor that arrives, in order, and a message takes the ones it announces. Only workers
send descriptors and shared memory: a worker receiving one closes the connection.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time
from collections import deque

from ..errors import FrameTooLarge, ProtocolError
from . import buffers, shm, wire
from .channel import Channel

_MAX_FDS = 2 * shm.MAX_NEW  # descriptors one read may bring (one message's, and the next's)
_ANC = socket.CMSG_SPACE(_MAX_FDS * 4)


class FdReader(wire.FrameReader):
    """A :class:`~torchfeed.protocol.wire.FrameReader` that keeps the descriptors that arrive.

    Descriptors travel with the first byte of their message; only the staged reads can
    reach a message's first byte (a direct read fills exactly the rest of the message being
    read), so only they ask for ancillary data."""

    def __init__(self, sock: socket.socket, initial: bytes = b""):
        super().__init__(sock, initial)
        self.fds: deque[int] = deque()

    def _receive(self, into: memoryview) -> int:
        got, anc, flags, _ = self.sock.recvmsg_into([into], _ANC, socket.MSG_CMSG_CLOEXEC)
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self.fds.extend(fds)
        if flags & socket.MSG_CTRUNC or len(self.fds) > _MAX_FDS:
            self.close_fds()
            raise ProtocolError("the peer sent more file descriptors than one message may carry")
        return got

    def close_fds(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())


class LocalChannel(Channel):
    """Message I/O on a same-host connection (see the module docstring).

    ``arena``: the worker's :class:`~torchfeed.protocol.shm.Arena` (replies are placed in
    it); ``mappings``: the trainer's :class:`~torchfeed.protocol.shm.Mappings`. Exactly one
    of them is given. Not thread safe, as :class:`~torchfeed.protocol.channel.Channel`."""

    local = True

    def __init__(
        self,
        sock: socket.socket,
        *,
        reader: FdReader,
        arena: shm.Arena | None = None,
        mappings: shm.Mappings | None = None,
    ):
        super().__init__(sock, bytes(32), bytes(32), encrypt=False, reader=reader)
        self._fd_reader = reader
        self.arena = arena
        self.mappings = mappings

    # -- records without seals ------------------------------------------------------
    def _seal_small(self, data) -> list:
        self._send_seq += 1
        return [data]

    def _open_into(self, dest: memoryview) -> None:
        self._recv_seq += 1
        self._fill(dest)
        self.last_activity = time.monotonic()  # the peer is alive (heartbeats read this)

    # -- sending ------------------------------------------------------------------
    def send(
        self, kind, request_id=0, meta=b"", buffers=(), flags=0, *, aux=0, packed=None, placed=None
    ) -> None:
        """Send one message; ``placed`` (a :class:`~torchfeed.protocol.shm.Placed`, made by the
        worker's executor with :meth:`~torchfeed.protocol.shm.Arena.place`) says which
        buffers travel in shared memory. Large buffers of a message sent without it are
        copied into slots here."""
        if packed is not None:
            raise ValueError("same-host connections send buffers as they are (no compression)")
        views = [memoryview(b).cast("B") for b in buffers]
        if placed is None and self.arena is not None:
            placed = self.arena.place(views)
        if placed is not None:
            flags |= wire.FLAG_SHM
        parts: list = [wire.pack_fixed(kind, request_id, len(meta), len(views), flags, aux)]
        if views:
            parts.append(struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views)))
        if placed is not None:
            parts.append(placed.table())
        if meta:
            parts.append(meta)
        parts += placed.inline(views) if placed is not None else [v for v in views if v.nbytes]
        # the new slots' descriptors go with the message's first bytes
        fds = placed.fds if placed is not None else []
        self._write(parts, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [])

    # -- receiving ----------------------------------------------------------------
    def read_header(self, limits: wire.Limits) -> wire.Frame:
        try:
            frame = super().read_header(limits)
        except FrameTooLarge as exc:  # authentic but too big: its table is read, so it can be skipped
            if exc.frame is not None and exc.frame.flags & wire.FLAG_SHM:
                self._shared(exc.frame)
            raise
        if frame.flags & wire.FLAG_SHM:
            self._shared(frame)
        if self._fd_reader.fds and self.mappings is None:
            self._fd_reader.close_fds()
            raise ProtocolError("a trainer may not send file descriptors to a worker")
        return frame

    def _shm_allowed(self) -> bool:
        return True

    def _shared(self, frame: wire.Frame) -> None:
        if self.mappings is None:
            raise ProtocolError("a trainer may not send shared memory to a worker")
        self._read_table(frame)

    def _read_table(self, frame: wire.Frame) -> None:
        def read(n: int) -> bytes:
            raw = bytearray(n)
            if n:
                self._open_into(memoryview(raw))
            return bytes(raw)

        assert self.mappings is not None
        new, dropped, where = shm.parse_table(read, len(frame.buffer_lengths))
        fds = self._fd_reader.fds
        if len(fds) < len(new):
            brought = len(fds)
            self._fd_reader.close_fds()
            raise ProtocolError(
                f"a reply announced {len(new)} shared slots and brought {brought} descriptors"
            )
        taken = [fds.popleft() for _ in new]
        self.mappings.drop(dropped)  # first: their room is the new slots'
        for k, ((slot_id, capacity), fd) in enumerate(zip(new, taken)):
            try:
                self.mappings.add(slot_id, capacity, fd)
            except BaseException:
                for other in taken[k + 1 :]:
                    os.close(other)
                raise
        frame.where = where

    def receive_buffers(self, frame: wire.Frame, pin: bool, peer: str) -> list[memoryview]:
        """The reply's buffers: views of their slots for the placed ones. With ``pin`` (and
        CUDA) all are copied into page-locked memory, as torch's pin_memory does: a slot
        registered with CUDA instead could be reused by the worker once its tensors are
        freed, while an asynchronous copy to the GPU still reads it."""
        if frame.where is None:
            return super().receive_buffers(frame, pin, peer)
        assert self.mappings is not None
        placed = self.mappings.views(frame.where, frame.buffer_lengths)
        inline = [n for n, view in zip(frame.buffer_lengths, placed) if view is None]
        received = buffers.allocate(inline) if inline else []
        self.read_buffers(received, None, peer)
        rest = iter(received)
        out = [view if view is not None else next(rest) for view in placed]
        if pin and buffers.cuda_pinnable():
            pinned_out = buffers.allocate(frame.buffer_lengths, True, arrived=True)
            for src, dst in zip(out, pinned_out):
                dst[:] = src
            return pinned_out
        return out

    def skip(self, frame: wire.Frame, meta: bool = True) -> None:
        if frame.where is None:
            super().skip(frame, meta)
            return
        assert self.mappings is not None
        self.mappings.release({slot for slot, _ in frame.where if slot})
        inline = [n for n, (slot, _) in zip(frame.buffer_lengths, frame.where) if slot == 0]
        rest = wire.Frame(frame.kind, frame.flags, frame.request_id, frame.meta, inline, frame.meta_len)
        super().skip(rest, meta)

    def close(self) -> None:
        """Let go of the descriptors, slots and mappings (idempotent: the connection's reader
        calls it again as it leaves, for descriptors that arrived meanwhile)."""
        self._fd_reader.close_fds()
        if self.arena is not None:
            self.arena.close()
        if self.mappings is not None:
            self.mappings.close()
