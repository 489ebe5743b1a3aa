"""A worker's reply is compressed only as its call allowed, and errors carry no buffers.

A real worker is made to compress every reply with zstd and to attach a compressed buffer
to its errors; the trainer refuses both before inflating or allocating anything for them,
fails that call only, and its connection goes on serving.
"""

from __future__ import annotations

import threading

import pytest
import torch

from torchfeed import client
from torchfeed.errors import ProtocolError
from torchfeed.protocol import auth, codec, serialize, wire
from torchfeed.protocol.channel import CHUNK

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("tcp_only")]  # tests of the wire


def _compress_everything() -> None:
    """On a worker: every reply's and error's buffers go out zstd-compressed (errors get one)."""
    from torchfeed.worker import serverconn as wc

    plain, plain_pack = wc.ServerConnection.send, codec.Chooser.pack
    chooser = codec.Chooser(CHUNK)

    def pack_zstd(self, buffers, mode, rate):
        return plain_pack(self, buffers, codec.ZSTD, rate)

    codec.Chooser.pack = pack_zstd  # type: ignore[method-assign]  # zstd forced, on purpose

    def send(self, kind, request_id=0, meta=b"", buffers=(), flags=0, packed=None, placed=None):
        if kind == wire.ERROR:
            buffers = [memoryview(bytes(1 << 20))]
        if kind in (wire.REPLY, wire.ERROR) and buffers and packed is None:
            packed = chooser.pack(list(buffers), codec.ZSTD, 0.0)
        return plain(self, kind, request_id, meta, buffers, flags, packed, placed)

    wc.ServerConnection.send = send  # type: ignore[method-assign]  # errors padded, on purpose


def _zeros():
    return torch.zeros(1 << 18)  # 1 MiB that compresses to almost nothing


def _fail():
    raise ZeroDivisionError("boom")


def _call(conn, fn, compression: int):
    done, out = threading.Event(), {}

    def callback(ok, value):
        out["ok"], out["value"] = ok, value
        done.set()

    meta, buffers = serialize.dumps((fn, (), {}), by_value=True)
    conn.request(wire.CALL, meta, buffers, callback=callback, timeout=30, compression=compression)
    assert done.wait(30), "no answer"
    return out["ok"], out["value"]


def test_replies_compressed_against_the_call_and_errors_with_buffers_are_refused(fresh_workers):
    address = fresh_workers(1).addresses[0]
    conn = client.Connection(address, auth.load_secret(), 30, session=client.default_session())
    try:
        assert _call(conn, _compress_everything, codec.NONE)[0]
        ok, value = _call(conn, _zeros, codec.NONE)  # compressed although the call asked for none
        assert not ok and isinstance(value, ProtocolError), value
        assert "compressed with zstd where the call asked for no compression" in str(value)
        ok, value = _call(conn, _zeros, codec.LZ4)  # another codec than the one asked for
        assert not ok and "asked for compression='lz4'" in str(value)
        ok, value = _call(conn, _fail, codec.AUTO)  # an error with a (compressed) buffer
        assert not ok and isinstance(value, ProtocolError) and "errors never carry buffers" in str(value)
        ok, value = _call(conn, _zeros, codec.AUTO)  # what the call allowed: read, on the same connection
        assert ok and torch.equal(value, _zeros())
    finally:
        conn.close()
