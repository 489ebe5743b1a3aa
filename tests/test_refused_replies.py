"""A hostile worker's refused replies end their calls, whatever follows them on the wire.

The "worker" here holds the secret and completes the real handshake (the doorman's own
``judge``), then answers the trainer's call with a reply the trainer refuses: compressed
where the call allowed none, or an error that carries buffers. The trainer has taken the
call out of its pending table with the reply's header; what follows (a corrupt size
table, a close or a stall mid-reply) must not leave that call waiting past its timeout.
"""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest

import torchfeed
from helpers import PROMPT, FakeWorker
from relay import C2W_SEALED
from torchfeed.errors import ProtocolError
from torchfeed.protocol import codec, wire
from torchfeed.protocol.channel import CHUNK, Channel

pytestmark = pytest.mark.timeout(120)

BIG = 2 * CHUNK  # a buffer of two chunks: its compressed form has a size table of two entries


def send_head(chan: Channel, kind: int, rid: int, lengths: list[int], codecs: bytes = b"") -> None:
    """The records of a message up to its buffers (the layout of protocol/channel.py): the
    header, the buffer lengths, the codec bytes of a packed reply, and a one-record meta."""
    meta = b"refused before it is read"
    flags = wire.FLAG_PACKED if codecs else 0
    chan.send_record(wire.pack_fixed(kind, rid, len(meta), len(lengths), flags))
    chan.send_record(struct.pack(f"<{len(lengths)}Q", *lengths))
    if codecs:
        chan.send_record(codecs)
    chan.send_record(meta)


def compressed_then_corrupt_table(chan: Channel, sock: socket.socket, rid: int) -> None:
    send_head(chan, wire.REPLY, rid, [BIG], bytes([codec.ZSTD]))
    chan.send_record(struct.pack("<2I", 0, 0))  # chunks of 0 bytes: refused by read_sizes


def compressed_then_close(chan: Channel, sock: socket.socket, rid: int) -> None:
    send_head(chan, wire.REPLY, rid, [BIG], bytes([codec.ZSTD]))
    chan.send_record(struct.pack("<2I", 10, 10))  # a sound table; its chunks never come
    sock.shutdown(socket.SHUT_RDWR)


def compressed_then_stall(chan: Channel, sock: socket.socket, rid: int) -> None:
    send_head(chan, wire.REPLY, rid, [BIG], bytes([codec.ZSTD]))  # and the rest never comes


def error_with_buffers_then_close(chan: Channel, sock: socket.socket, rid: int) -> None:
    send_head(chan, wire.ERROR, rid, [BIG])
    chan.send_record(bytes(CHUNK))  # half of the buffer
    sock.shutdown(socket.SHUT_RDWR)


class HostileWorker(FakeWorker):
    """Listens on loopback, completes the real handshake with the tests' secret, reads one
    call and answers it with ``answer(channel, socket, request id)``; then holds the
    connection until closed."""

    def __init__(self, answer):
        self.answer = answer
        listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{listener.getsockname()[1]}"
        super().__init__(listener)

    def serve(self, sock, keys, received: bytes) -> None:
        chan = keys.channel(sock, wire.FrameReader(sock, received[C2W_SEALED:]))
        call = chan.read_frame(wire.Limits())
        chan.skip(call, meta=False)
        self.answer(chan, sock, call.request_id)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (compressed_then_corrupt_table, "compressed with zstd where the call asked for no compression"),
        (compressed_then_close, "compressed with zstd where the call asked for no compression"),
        (compressed_then_stall, "compressed with zstd where the call asked for no compression"),
        (error_with_buffers_then_close, "errors never carry buffers"),
    ],
    ids=["corrupt-size-table", "close-mid-reply", "stall-mid-reply", "error-with-buffers-close"],
)
def test_a_refused_reply_ends_its_call_whatever_follows(answer, why):
    worker = HostileWorker(answer)
    # heartbeats far beyond the bound: only the refusal itself may end the call
    session = torchfeed.Session(compression=None, heartbeat_interval=30, heartbeat_timeout=60)
    try:
        future = session.rpc_async(worker.address, os.getpid, timeout=5)
        ended = threading.Event()
        future.add_done_callback(lambda _: ended.set())
        assert worker.answered.wait(PROMPT) and worker.failure is None, worker.failure
        assert ended.wait(30), "the call still waits long after its 5 s timeout"
        with pytest.raises(ProtocolError, match=why) as info:
            future.wait()
        assert "the reply is dropped" in str(info.value)
    finally:
        session.close()
        worker.close()
