"""The sealed record layer every message travels in after the handshake.

Each direction of a connection has its own 256-bit AES-GCM key (derived by
:mod:`torchfeed.protocol.auth` from the shared secret and both handshake nonces) and its own
record counter, which is the GCM nonce. A message (see :mod:`torchfeed.protocol.wire`) is sent
as a sequence of sealed records::

    [header: 28 bytes + tag]
    [buffer lengths (8 x n bytes, when n > 0), in chunks of at most CHUNK bytes, each + tag]
    [meta, in chunks of at most CHUNK bytes, each + tag]
    [each buffer, in chunks of at most CHUNK bytes, each + tag]

Every record is authenticated under the next counter value, so a flipped bit, a
replayed, dropped, reordered or injected record fails its tag check and raises
:class:`IntegrityError`; the connection is then closed by its owner. Because the header
is a record of its own, the lengths it announces are authentic before anything is
allocated for them, and a message too large for this side can be skipped record by
record without losing the stream. Even an authentic header is not trusted with memory:
the meta is allocated record by record as records arrive (a peer holding the secret
that announces 1 GiB and stalls makes this side hold nothing), and buffers land in
memory the caller supplies.

Receiving keeps the zero-copy path: a buffer chunk is received into a small scratch
block (it stays in cache) and decrypted straight into the caller's final, possibly
pinned, memory.

``encrypt=False`` (the trusted-network opt-out, see :mod:`torchfeed.protocol.auth`) keeps the
layout and the integrity: each record is sent in clear followed by a GMAC tag over it
(AES-GCM with the record as associated data), so tampering, replay and injection are
still detected; only confidentiality is given up.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import FrameTooLarge, ProtocolError
from . import codec, wire

TAG = 16
CHUNK = 256 * 1024  # plaintext bytes per record: large enough to amortise, small enough for cache
_NONCE = struct.Struct(">4xQ")
_SEND_BATCH = 1 << 20  # sealed bytes gathered into one sendmsg
MAX_CHUNKS = 1 << 22  # chunks of one compressed buffer a receiver reads (1 TiB; its size table: 16 MiB)


class IntegrityError(ProtocolError):
    """A record failed authentication: tampered with, replayed, reordered or injected."""


class Channel:
    """Sealed message I/O over a connected blocking socket.

    Not thread safe: one thread reads, and sends are serialised by the owner (one lock
    or one writer thread), because each record consumes the next counter value.
    """

    local = False  # a same-host channel (protocol.localchannel) says True

    def __init__(
        self,
        sock: socket.socket,
        send_key: bytes,
        recv_key: bytes,
        *,
        encrypt: bool = True,
        reader: wire.FrameReader | None = None,
    ):
        self.sock = sock
        self._reader = reader or wire.FrameReader(sock)  # the staged byte stream under the records
        self.encrypt = encrypt
        self._send_aead = AESGCM(send_key)
        self._recv_aead = AESGCM(recv_key)
        self._send_seq = 0
        self._recv_seq = 0
        self._scratch_out: bytearray | None = None  # made on the first large send
        self._scratch_in = bytearray(CHUNK + TAG)
        self._scratch_skip: memoryview | None = None  # made on the first skip of a payload
        self._scratch_meta: memoryview | None = None  # made on the first meta of several records
        self._scratch_codec: memoryview | None = None  # made on the first compressed chunk received
        # with SO_SNDTIMEO set on the socket: seconds without progress before a send fails
        self.send_stall_timeout: float | None = None
        # when a record last arrived, or a large write last went out: the peer is alive
        self.last_activity = time.monotonic()

    # -- sending -----------------------------------------------------------
    def _next_send_nonce(self) -> bytes:
        nonce = _NONCE.pack(self._send_seq)
        self._send_seq += 1
        return nonce

    def _seal_small(self, data) -> list:
        nonce = self._next_send_nonce()
        if self.encrypt:
            return [self._send_aead.encrypt(nonce, bytes(data), None)]
        return [data, self._send_aead.encrypt(nonce, b"", data)]

    @staticmethod
    def _plaintexts(
        kind: int, request_id: int, meta: bytes, views: list, flags: int, aux: int = 0, packed=None
    ):
        """The plaintext of each record of a message, in order (the layout in the module doc
        and, for a packed message, in :mod:`torchfeed.protocol.codec`)."""
        lengths = [len(v) for v in views] if packed is None else packed.lengths
        if packed is not None:
            flags |= wire.FLAG_PACKED
        yield memoryview(wire.pack_fixed(kind, request_id, len(meta), len(lengths), flags, aux))
        heads = [memoryview(struct.pack(f"<{len(lengths)}Q", *lengths))] if lengths else []
        if packed is not None:
            heads.append(memoryview(packed.codecs))
        bodies = views if packed is None else packed.bodies
        for payload in heads + ([memoryview(meta)] if meta else []) + bodies:
            if isinstance(payload, list):  # a compressed buffer: its sizes table, then a record per chunk
                table, *chunks = payload
                yield from Channel._cut(memoryview(table))
                yield from (memoryview(c) for c in chunks)
            else:
                yield from Channel._cut(payload)

    @staticmethod
    def _cut(payload: memoryview):
        for start in range(0, len(payload), CHUNK):
            yield payload[start : start + CHUNK]

    def send(
        self,
        kind: int,
        request_id: int = 0,
        meta: bytes = b"",
        buffers: Sequence = (),
        flags: int = 0,
        *,
        aux: int = 0,
        packed=None,
        placed=None,
    ) -> None:
        """Seal and send one message; large buffers are sealed chunk by chunk.

        ``packed`` (a :class:`torchfeed.protocol.codec.Packed`) sends compressed buffers
        in place of ``buffers`` (then empty: the original memory need not stay alive).
        ``placed`` (shared memory) exists only on same-host channels."""
        if placed is not None:
            raise ValueError("shared memory is only for same-host connections")
        views = [memoryview(b).cast("B") for b in buffers]
        records = self._plaintexts(kind, request_id, meta, views, flags, aux, packed)
        parts: list = self._seal_small(next(records))  # the header
        pending = sum(memoryview(p).nbytes for p in parts)
        offset = 0  # used part of the outgoing scratch
        for chunk in records:
            nonce = self._next_send_nonce()
            if self.encrypt:
                if self._scratch_out is None:
                    self._scratch_out = bytearray(_SEND_BATCH + CHUNK + TAG)
                out = memoryview(self._scratch_out)[offset : offset + len(chunk) + TAG]
                self._send_aead.encrypt_into(nonce, chunk, None, out)
                offset += len(out)
                parts.append(out)
            else:
                parts += [chunk, self._send_aead.encrypt(nonce, b"", chunk)]
            pending += len(chunk) + TAG
            if pending >= _SEND_BATCH:
                self._write(parts)
                parts, pending, offset = [], 0, 0
        if parts:
            self._write(parts)

    def seal(
        self, kind: int, request_id: int = 0, meta: bytes = b"", buffers: Sequence = (), flags: int = 0
    ) -> bytes:
        """Seal a whole small message (meta and each buffer at most CHUNK bytes) into one
        bytes object, the same records :meth:`send` writes. The records take their counter
        values now: the caller must write the result before anything else is sealed."""
        views = [memoryview(b).cast("B") for b in buffers]
        if len(meta) > CHUNK or 8 * len(views) > CHUNK or any(len(v) > CHUNK for v in views):
            raise ValueError("seal() takes small messages only; use send()")
        return b"".join(
            sealed
            for plaintext in self._plaintexts(kind, request_id, meta, views, flags)
            for sealed in self._seal_small(plaintext)
        )

    def write_nowait(self, data: bytes) -> memoryview:
        """Write what the socket takes now of ``data`` without blocking; return the rest
        (to be written with :meth:`write` before anything sealed later)."""
        try:
            n = self.sock.send(data, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            n = 0
        return memoryview(data)[n:]

    def write(self, data) -> None:
        """Write already sealed bytes (the rest :meth:`write_nowait` left), blocking."""
        self._write([data])

    def send_record(self, plaintext: bytes) -> None:
        """Seal and send one record of arbitrary content (for tests and protocol tools)."""
        self._write(self._seal_small(plaintext))

    def _write(self, parts: list, ancillary: Sequence = ()) -> None:
        wire.sendmsg_all(self.sock, parts, self.send_stall_timeout, ancillary)
        n = sum(memoryview(p).nbytes for p in parts)
        if n >= _SEND_BATCH:  # a write this large only completes while the peer reads
            self.last_activity = time.monotonic()

    # -- receiving -----------------------------------------------------------
    def _next_recv_nonce(self) -> bytes:
        nonce = _NONCE.pack(self._recv_seq)
        self._recv_seq += 1
        return nonce

    @property
    def bytes_received(self) -> int:
        return self._reader.bytes_received

    @property
    def bytes_consumed(self) -> int:
        """:attr:`FrameReader.bytes_consumed` of this channel's stream: its difference across one
        frame is the frame's size on the wire (``bytes_received`` also counts bytes staged ahead
        of the next frame)."""
        return self._reader.bytes_consumed

    def _fill(self, dest: memoryview) -> None:
        """Fill ``dest`` exactly from the stream (staged bytes first, then straight in)."""
        self._reader.read_into(dest)

    def _open_into(self, dest: memoryview) -> None:
        """Receive one record whose plaintext is ``len(dest)`` bytes into ``dest``."""
        n = len(dest)
        nonce = self._next_recv_nonce()
        try:
            if self.encrypt:
                sealed = memoryview(self._scratch_in)[: n + TAG]  # n <= CHUNK: callers chunk
                self._fill(sealed)
                self._recv_aead.decrypt_into(nonce, sealed, None, dest)
            else:
                self._fill(dest)
                tag = memoryview(self._scratch_in)[:TAG]
                self._fill(tag)
                self._recv_aead.decrypt(nonce, bytes(tag), dest)
            self.last_activity = time.monotonic()
        except InvalidTag:
            raise IntegrityError(
                f"record {self._recv_seq - 1} failed authentication: the stream was tampered with, "
                "replayed or injected into (or the peer is not who it claims)"
            ) from None

    def _open_payload(self, dest: memoryview) -> None:
        for start in range(0, len(dest), CHUNK):
            self._open_into(dest[start : start + CHUNK])

    def read_header(self, limits: wire.Limits) -> wire.Frame:
        """Read and authenticate a message's header and buffer lengths.

        Then read the meta (:meth:`read_meta`) and the buffers (:meth:`read_buffers`), or
        skip the rest (:meth:`skip`). Raises :class:`FrameTooLarge` after the header is
        authenticated when it announces more than ``limits``; the stream is still in
        sync, so the caller may :meth:`skip` the message and go on.
        """
        head = bytearray(wire.HEADER.size)
        self._open_into(memoryview(head))
        kind, flags, request_id, meta_len, nbuf, aux = wire.parse_header(bytes(head))
        if flags & wire.FLAG_SHM and not self._shm_allowed():
            raise ProtocolError("shared memory announced on a connection from another host")
        if nbuf > limits.max_buffers:
            raise ProtocolError(f"{nbuf} buffers exceed the limit of {limits.max_buffers}")
        lengths: list[int] = []
        if nbuf:
            raw = bytearray(8 * nbuf)
            self._open_payload(memoryview(raw))
            lengths = list(struct.unpack(f"<{nbuf}Q", raw))
        frame = wire.Frame(kind, flags, request_id, b"", lengths, meta_len, aux)
        if flags & wire.FLAG_PACKED:
            codecs = bytearray(nbuf)
            self._open_payload(memoryview(codecs))
            if any(c not in codec.CODEC_NAMES for c in codecs):
                raise ProtocolError(f"unknown codec in {list(set(codecs) - set(codec.CODEC_NAMES))}")
            frame.codecs = bytes(codecs)
        try:
            wire.check_limits(frame, limits)
        except FrameTooLarge as exc:
            exc.frame = frame  # authentic: the caller may skip it and stay connected
            raise
        return frame

    def read_meta(self, frame: wire.Frame) -> bytes:
        """Read the meta, allocating record by record as records arrive: a header that
        announces a large meta and stalls costs nothing (not the announced size up front)."""
        n = frame.meta_len
        if n == 0:  # no record at all (heartbeats)
            frame.meta = b""
        elif n <= CHUNK:  # one record: the usual small pickle
            meta = bytearray(n)
            self._open_into(memoryview(meta))
            frame.meta = bytes(meta)
        else:  # grown as records arrive (realloc: no copy of what is there)
            meta = bytearray()
            plain = self._scratch_meta
            if plain is None:
                plain = self._scratch_meta = memoryview(bytearray(CHUNK))
            for start in range(0, n, CHUNK):
                part = plain[: min(CHUNK, n - start)]
                self._open_into(part)
                meta += part
            frame.meta = bytes(meta)
        return frame.meta

    def read_frame(self, limits: wire.Limits) -> wire.Frame:
        """Header and meta of the next message; its buffers stay unread."""
        frame = self.read_header(limits)
        self.read_meta(frame)
        return frame

    def _shm_allowed(self) -> bool:
        return False

    def receive_buffers(self, frame: wire.Frame, pin: bool, peer: str) -> list[memoryview]:
        """The buffers of ``frame`` (after its meta), in one block allocated for them
        (page-locked when ``pin`` asks and CUDA is here; ``peer`` names the sender in errors)."""
        from .buffers import allocate, pinned  # torch: not imported by the command line's --help

        buffers = allocate(frame.buffer_lengths, pin)
        self.read_buffers(buffers, frame, peer)
        return pinned(buffers, frame.buffer_lengths, pin)  # page-locked once a large reply is here

    def close(self) -> None:
        """Let go of what the channel holds beside its socket (nothing, here)."""

    def read_buffers(
        self, dests: Sequence[memoryview], frame: wire.Frame | None = None, peer: str = ""
    ) -> None:
        """Receive the buffers of ``frame`` into ``dests`` (decompressing those its codecs
        say are compressed, record by record, into their place; ``peer`` names the sender
        in errors)."""
        codecs = frame.codecs if frame is not None else b""
        for i, d in enumerate(dests):
            d = d.cast("B") if d.format != "B" or d.ndim != 1 else d
            kind = codecs[i] if codecs else codec.NONE
            if kind == codec.NONE:
                self._open_payload(d)
                continue
            scratch = self._scratch_codec
            if scratch is None:
                scratch = self._scratch_codec = memoryview(bytearray(CHUNK))
            for start, size in zip(range(0, len(d), CHUNK), self._sizes(len(d), peer)):
                piece = min(CHUNK, len(d) - start)
                if size == piece:  # stored as it is
                    self._open_into(d[start : start + piece])
                else:
                    self._open_into(scratch[:size])
                    codec.decompress_into(kind, scratch[:size], d[start : start + piece], peer)

    def _sizes(self, n: int, peer: str) -> list[int]:
        """The chunk sizes of a compressed buffer of ``n`` bytes: its whole table (every
        record of it comes before the buffer's chunks), checked."""
        per_record = CHUNK // 4
        count = -(-n // CHUNK)
        if count > MAX_CHUNKS:
            raise ProtocolError(
                f"a compressed buffer of {n:,} bytes from worker {peer or '?'} is more than this side reads "
                f"compressed ({MAX_CHUNKS * CHUNK:,} bytes): the connection is dropped"
            )
        table = memoryview(bytearray(4 * min(per_record, count)))
        sizes: list[int] = []
        for first in range(0, count, per_record):
            part = [min(CHUNK, n - k * CHUNK) for k in range(first, min(count, first + per_record))]
            self._open_into(table[: 4 * len(part)])
            sizes += codec.read_sizes(table[: 4 * len(part)], part, peer)
        return sizes

    def skip(self, frame: wire.Frame, meta: bool = True) -> None:
        """Authenticate and discard the unread rest of ``frame`` (its meta when
        ``meta`` is true, and its buffers)."""
        if not (frame.meta_len or frame.buffer_lengths):
            return  # heartbeats have nothing to skip: no allocation
        scratch = self._scratch_skip
        if scratch is None:
            scratch = self._scratch_skip = memoryview(bytearray(CHUNK))
        if meta:
            for start in range(0, frame.meta_len, CHUNK):
                self._open_into(scratch[: min(CHUNK, frame.meta_len - start)])
        for i, n in enumerate(frame.buffer_lengths):
            packed = bool(frame.codecs) and frame.codecs[i] != codec.NONE
            sizes = self._sizes(n, "") if packed else (min(CHUNK, n - s) for s in range(0, n, CHUNK))
            for size in sizes:
                self._open_into(scratch[:size])
