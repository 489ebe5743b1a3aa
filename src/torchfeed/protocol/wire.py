"""Framing of the data plane: one message = header + buffer lengths + meta + buffers.

Layout (little endian)::

    magic "TFED" | version u8 | kind u8 | flags u16 | request id u64
    | meta length u32 | buffer count u32 | aux u32
    | buffer count x u64 lengths | meta bytes | buffers...

The meta part is a small pickle (or raw handshake bytes); the buffers are the
out-of-band payloads (tensor and array bytes). Every length is checked against a
:class:`Limits` before anything is allocated, and buffers are received straight into
memory supplied by the caller, so a reply lands in its final (possibly pinned) tensor.
This module knows nothing about pickling or authentication.

Only the handshake travels in this clear form (:func:`send_frame`, :class:`FrameReader`);
after it, the same header and parts travel sealed by :mod:`torchfeed.protocol.channel`.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import FrameTooLarge, ProtocolError

MAGIC = b"TFED"
# Changes with the framing, the handshake, or the module paths pickles name (CHANGELOG.md
# lists what each version changed): peers of other versions are refused at the header.
VERSION = 6
HEADER = struct.Struct("<4sBBHQIII")

# message kinds
HELLO = 1  # worker -> client: nonce (handshake step 1)
AUTH = 2  # client -> worker: client nonce, mode, the endpoint it dialled, proof
AUTH_OK = 3  # worker -> client: worker proof
AUTH_FAIL = 4  # worker -> client: short reason text
CALL = 10  # client -> worker: cloudpickled (func, args, kwargs, options)
CALL_REF = 11  # client -> worker: call a registered object: pickled (ref id, args, options)
REPLY = 12  # worker -> client: pickled result (+ out-of-band buffers)
ERROR = 13  # worker -> client: pickled (type, message, traceback) of a failed request
RELEASE = 14  # client -> worker: pickled list of remote reference ids to free
PING = 15
PONG = 16
CANCEL = 17  # client -> worker: pickled list of request ids to drop if not started
BYE = 18  # worker -> client: the worker refuses this connection (reason text), then closes
STATS = 19  # client -> worker: send the process's statistics (answered with a REPLY)

KIND_NAMES = {
    v: k
    for k, v in dict(
        HELLO=HELLO,
        AUTH=AUTH,
        AUTH_OK=AUTH_OK,
        AUTH_FAIL=AUTH_FAIL,
        CALL=CALL,
        CALL_REF=CALL_REF,
        REPLY=REPLY,
        ERROR=ERROR,
        RELEASE=RELEASE,
        PING=PING,
        PONG=PONG,
        CANCEL=CANCEL,
        BYE=BYE,
        STATS=STATS,
    ).items()
}

# flags
FLAG_RREF = 1  # CALL / CALL_REF: keep the result on the worker, reply with a reference id
# CALL / CALL_REF: how the reply's buffers may be compressed (protocol.codec.MODES), two bits;
# with auto, the header's aux field is the trainer's measured reply rate (KiB/s, 0: unknown)
FLAG_CODEC_SHIFT = 1
FLAG_CODEC = 3 << FLAG_CODEC_SHIFT
FLAG_PACKED = 8  # REPLY: a codec byte per buffer follows the length table (protocol.codec)
# REPLY on a same-host connection only: a shared-memory table follows the length table
# (protocol.shm): new slots, dropped slots, and where each buffer was placed
FLAG_SHM = 16

_STAGING = 4096  # small reads go through a staging buffer to save syscalls
_DIRECT = _STAGING  # reads at least this long go straight into the destination
_IOV_MAX = 512


@dataclass(frozen=True)
class Limits:
    """Upper bounds on what one received message may announce.

    Checked before any allocation; anything above raises :class:`FrameTooLarge`.
    """

    max_meta: int = 256 * 1024 * 1024
    max_buffers: int = 65536
    max_buffer_bytes: int = 64 * 1024**3  # sum of all buffer lengths of one message
    knob: str = ""  # how to raise these limits, quoted in FrameTooLarge messages


# Before authentication only handshake messages of a few bytes are acceptable.
HANDSHAKE_LIMITS = Limits(max_meta=512, max_buffers=0, max_buffer_bytes=0)


@dataclass
class Frame:
    kind: int
    flags: int
    request_id: int
    meta: bytes
    buffer_lengths: list[int]
    meta_len: int = 0
    aux: int = 0  # CALL: the trainer's measured reply rate in KiB/s (see FLAG_CODEC)
    codecs: bytes = b""  # a packed REPLY: one codec per buffer (protocol.codec)
    where: list | None = None  # FLAG_SHM: per buffer (slot id, offset); slot 0: in the message

    @property
    def size(self) -> int:
        """Bytes of the message's parts (meta and buffers)."""
        return self.meta_len + sum(self.buffer_lengths)


def pack_fixed(kind: int, request_id: int, meta_len: int, nbuf: int, flags: int = 0, aux: int = 0) -> bytes:
    """The fixed 28-byte header alone."""
    return HEADER.pack(MAGIC, VERSION, kind, flags, request_id, meta_len, nbuf, aux)


def parse_header(raw: bytes):
    """Check a fixed header; return ``(kind, flags, request_id, meta_len, nbuf, aux)``."""
    magic, version, kind, flags, request_id, meta_len, nbuf, aux = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: the peer is not a torchfeed endpoint")
    if version != VERSION:
        raise ProtocolError(
            f"peer speaks torchfeed wire version {version}, this side speaks {VERSION}: "
            "install the same torchfeed version on trainers and workers"
        )
    if kind not in KIND_NAMES:
        raise ProtocolError(f"unknown message kind {kind}")
    return kind, flags, request_id, meta_len, nbuf, aux


def check_limits(frame: Frame, limits: Limits) -> None:
    """Raise :class:`FrameTooLarge` when ``frame`` announces more than ``limits`` allow."""
    hint = f"; {limits.knob}" if limits.knob else ""
    if frame.meta_len > limits.max_meta:
        raise FrameTooLarge(
            f"{KIND_NAMES[frame.kind]} message of {frame.meta_len:,} bytes of pickled data exceeds "
            f"the limit of {limits.max_meta:,}{hint}"
        )
    total = sum(frame.buffer_lengths)
    if total > limits.max_buffer_bytes:
        raise FrameTooLarge(
            f"{KIND_NAMES[frame.kind]} message of {total:,} bytes of buffers exceeds the limit of "
            f"{limits.max_buffer_bytes:,}{hint}"
        )


def pack_header(
    kind: int, request_id: int, meta_len: int, buffer_lengths: Sequence[int], flags: int = 0
) -> bytes:
    head = pack_fixed(kind, request_id, meta_len, len(buffer_lengths), flags)
    if buffer_lengths:
        head += struct.pack(f"<{len(buffer_lengths)}Q", *buffer_lengths)
    return head


def send_frame(
    sock: socket.socket,
    kind: int,
    request_id: int = 0,
    meta: bytes = b"",
    buffers: Sequence[memoryview] = (),
    flags: int = 0,
) -> None:
    """Send one message with a single gathered write where possible (no joining copies)."""
    lengths = [memoryview(b).nbytes for b in buffers]
    parts: list[bytes | memoryview] = [pack_header(kind, request_id, len(meta), lengths, flags)]
    if meta:
        parts.append(meta)
    parts.extend(memoryview(b).cast("B") for b, n in zip(buffers, lengths) if n)
    sendmsg_all(sock, parts)


def sendmsg_all(
    sock: socket.socket, parts: list, stall_timeout: float | None = None, ancillary: Sequence = ()
) -> None:
    """Write every byte of ``parts`` (a list of bytes-like objects), handling partial writes;
    ``ancillary`` (``sendmsg``'s, e.g. descriptors) goes with the first bytes written.

    On a socket with a send timeout (``SO_SNDTIMEO``), a peer that reads nothing for
    ``stall_timeout`` seconds raises :class:`TimeoutError`.
    """
    views = [memoryview(p).cast("B") for p in parts]
    i = 0
    progress = time.monotonic()
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        try:
            sent = sock.sendmsg(batch, ancillary) if ancillary else sock.sendmsg(batch)
            ancillary = ()
        except BlockingIOError:
            if stall_timeout is None or time.monotonic() - progress > stall_timeout:
                raise TimeoutError(f"the peer read nothing for {stall_timeout} s") from None
            continue
        progress = time.monotonic()
        # advance over fully written parts, trim the partially written one
        while sent and i < len(views):
            n = len(views[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
        while i < len(views) and len(views[i]) == 0:
            i += 1


class FrameReader:
    """Reads frames from a blocking socket.

    Small reads are served from a staging buffer; large payloads are received with
    ``recv_into`` straight into the caller's memory.
    """

    def __init__(self, sock: socket.socket, initial: bytes = b""):
        self.sock = sock
        self._buf = bytearray(max(_STAGING, len(initial)))
        self._view = memoryview(self._buf)
        self._buf[: len(initial)] = initial  # bytes already received (read past a handshake)
        self._start = 0
        self._end = len(initial)
        self.bytes_received = 0

    @property
    def bytes_consumed(self) -> int:
        """The stream's bytes handed on so far: those received less those still staged. Only
        differences mean something (bytes staged at the start, left over from a handshake, were
        never counted as received): across one frame, its size on the wire, even where a staged
        read ran into the next frame."""
        return self.bytes_received - (self._end - self._start)

    # -- low level -------------------------------------------------------
    def _recv_some(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        got = self._receive(self._view[self._end :])
        if not got:
            raise ConnectionError("connection closed by peer")
        self._end += got
        self.bytes_received += got

    def _receive(self, into: memoryview) -> int:
        """One staged read from the socket (a subclass may take ancillary data with it)."""
        return self.sock.recv_into(into)

    def _take(self, n: int) -> bytes:
        """Return exactly n bytes (n <= staging size)."""
        while self._end - self._start < n:
            self._recv_some()
        out = bytes(self._view[self._start : self._start + n])
        self._start += n
        return out

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` completely from the stream."""
        dest = dest.cast("B") if dest.format != "B" or dest.ndim != 1 else dest
        total = len(dest)
        pos = 0
        avail = self._end - self._start
        if avail:
            n = min(avail, total)
            dest[:n] = self._view[self._start : self._start + n]
            self._start += n
            pos = n
        while pos < total:
            remaining = total - pos
            if remaining >= _DIRECT:
                got = self.sock.recv_into(dest[pos:], remaining, socket.MSG_WAITALL)
                if not got:
                    raise ConnectionError("connection closed by peer")
                self.bytes_received += got
                pos += got
            else:
                self._recv_some()
                n = min(self._end - self._start, remaining)
                dest[pos : pos + n] = self._view[self._start : self._start + n]
                self._start += n
                pos += n

    # -- frames ----------------------------------------------------------
    def read_frame(self, limits: Limits) -> Frame:
        """Read a header, its buffer lengths and its meta; buffers stay unread.

        The caller must then call :meth:`read_buffers` (or :meth:`skip_buffers`).
        """
        kind, flags, request_id, meta_len, nbuf, _ = parse_header(self._take(HEADER.size))
        if nbuf > limits.max_buffers:
            raise FrameTooLarge(f"{nbuf} buffers exceed the limit of {limits.max_buffers}")
        lengths: list[int] = []
        if nbuf:
            raw = bytearray(nbuf * 8)
            self.read_into(memoryview(raw))
            lengths = list(struct.unpack(f"<{nbuf}Q", raw))
        check_limits(Frame(kind, flags, request_id, b"", lengths, meta_len), limits)
        if meta_len <= _STAGING:
            meta = self._take(meta_len)
        else:
            meta_buf = bytearray(meta_len)
            self.read_into(memoryview(meta_buf))
            meta = bytes(meta_buf)
        return Frame(kind, flags, request_id, meta, lengths, meta_len)

    def read_buffers(self, dests: Sequence[memoryview]) -> None:
        for d in dests:
            self.read_into(d)

    def skip_buffers(self, lengths: Sequence[int]) -> None:
        scratch = memoryview(bytearray(min(max(lengths, default=0), 1 << 20)))
        for n in lengths:
            while n:
                k = min(n, len(scratch))
                self.read_into(scratch[:k])
                n -= k
