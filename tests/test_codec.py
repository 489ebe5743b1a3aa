"""Compressed replies (torchfeed.protocol.codec): every codec choice gives torch's batches,
mixed compressible and incompressible buffers, chunks stored raw, corrupt compressed data
from a worker (its connection dropped, its batches loaded elsewhere, nothing lost), packed
replies skipped whole, and the statistics that show wire bytes beside logical bytes."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import termios
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torchfeed
from helpers import PROMPT, wait_for
from torchfeed import RemoteDataLoader, RemoteDataset, client
from torchfeed.errors import FrameTooLarge, ProtocolError
from torchfeed.protocol import codec, wire
from torchfeed.protocol.channel import CHUNK, Channel
from torchfeed.stats import LoaderStats, advise

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("tcp_only")]  # tests of the wire


class Mixed(Dataset):
    """Each sample: compressible token ids, an incompressible image, a half-and-half array
    (zeros then noise) and a scalar: one batch mixes every kind of buffer."""

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        half = np.zeros(40_000, dtype=np.uint8)
        half[20_000:] = np.random.default_rng(i).integers(0, 256, 20_000, dtype=np.uint8)
        return {
            "ids": torch.randint(0, 32_000, (2048,), generator=g),
            "image": torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=g),
            "half": half,
            "i": i,
        }


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return torch.equal(torch.as_tensor(a), torch.as_tensor(b))


@pytest.mark.parametrize("compression", [None, "lz4", "zstd", "auto"])
def test_every_choice_gives_torchs_batches(workers2, compression):
    ds = RemoteDataset(workers2, Mixed)
    loader = RemoteDataLoader(ds, batch_size=16, compression=compression)
    got = list(loader)
    expected = list(DataLoader(Mixed(), batch_size=16))
    assert len(got) == len(expected)
    assert all(_equal(a, b) for a, b in zip(got, expected))
    stats = loader.stats()
    if compression in ("lz4", "zstd"):  # token ids and zeros shrink; the image does not
        assert stats.wire_bytes_received < 0.8 * stats.bytes_received, stats
    elif compression is None:
        assert stats.wire_bytes_received >= stats.bytes_received
    ds.close()


def test_a_bad_choice_says_what_to_use(workers2):
    ds = RemoteDataset(workers2, Mixed)
    with pytest.raises(ValueError, match="'auto'.*'lz4', 'zstd', or None"):
        RemoteDataLoader(ds, compression="gzip")
    with pytest.raises(ValueError, match="compression='snappy'"):
        torchfeed.Session(compression="snappy")
    ds.close()


# -- the record layer ---------------------------------------------------------------------


def _pair():
    a, b = socket.socketpair()
    k1, k2 = os.urandom(32), os.urandom(32)
    return a, b, Channel(a, k1, k2), Channel(b, k2, k1)


def _send_in_thread(target, *args, **kwargs):
    t = threading.Thread(target=target, args=args, kwargs=kwargs, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("kind", [codec.LZ4, codec.ZSTD])
def test_packed_buffers_land_whole_and_raw_chunks_travel_as_they_are(kind, encrypt):
    a, b, tx, rx = _pair()
    tx.encrypt = rx.encrypt = encrypt
    rng = np.random.default_rng(0)
    zeros_then_noise = np.concatenate(
        [np.zeros(3 * CHUNK, np.uint8), rng.integers(0, 256, 2 * CHUNK + 77, np.uint8)]
    )
    buffers = [
        zeros_then_noise.data,
        rng.integers(0, 256, 100_000, np.uint8).data,  # incompressible: stored raw
        np.arange(70_000, dtype=np.int64).view(np.uint8).data,
        memoryview(b"tiny"),  # below MIN_BYTES: never compressed
    ]
    packed = codec.Chooser(CHUNK).pack(buffers, kind, 0.0)
    assert packed is not None and packed.codecs[3] == codec.NONE
    assert packed.wire_bytes < sum(x.nbytes for x in buffers)
    t = _send_in_thread(tx.send, wire.REPLY, 7, b"meta", (), packed=packed)
    frame = rx.read_frame(wire.Limits())
    assert frame.flags & wire.FLAG_PACKED and frame.meta == b"meta"
    assert frame.buffer_lengths == [x.nbytes for x in buffers]
    dests = [memoryview(bytearray(n)) for n in frame.buffer_lengths]
    rx.read_buffers(dests, frame, "w")
    t.join(10)
    assert [bytes(d) for d in dests] == [bytes(x) for x in buffers]
    # the stream stays in step: a plain message after it reads as it should
    _send_in_thread(tx.send, wire.PONG, 8)
    assert rx.read_frame(wire.Limits()).request_id == 8
    a.close(), b.close()


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_frames_wire_size_stops_at_its_last_byte_when_the_next_frame_is_already_read(encrypt):
    a, b, tx, rx = _pair()
    tx.encrypt = rx.encrypt = encrypt
    small = memoryview(b"x" * 1000)
    # both frames in one write: the first staged read takes the second frame's bytes too
    tx.send(wire.REPLY, 1, b"m", (small,))
    tx.send(wire.REPLY, 2, b"m", (small,))
    sizes = []
    for _ in range(2):
        before = rx.bytes_consumed
        frame = rx.read_frame(wire.Limits())
        rx.read_buffers([memoryview(bytearray(n)) for n in frame.buffer_lengths], frame, "w")
        sizes.append(rx.bytes_consumed - before)
    assert sizes[0] == sizes[1] > 1000  # each frame its own bytes, header and seal included
    assert rx.bytes_consumed == rx.bytes_received  # nothing staged is left unaccounted
    a.close(), b.close()


def _unread(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``'s receive queue."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def test_replies_that_arrive_together_each_count_their_own_wire_bytes(workers2):
    conn = client.connect(workers2[0])
    n, done = 12, threading.Event()
    overheads: list[int] = []
    piled: list[bool] = []

    def got(ok, value):
        wire_bytes = client.reply_wire()[0]
        if not overheads:  # hold the reader until the next replies wait in the socket together
            piled.append(wait_for(lambda: _unread(conn.sock) >= 2 * wire_bytes, timeout=PROMPT))
        overheads.append(wire_bytes - client.reply_bytes())  # the same for every reply of one shape
        if len(overheads) == n:
            done.set()

    for _ in range(n):
        conn.request(wire.STATS, b"", callback=got, timeout=PROMPT, policy=client.JSON_REPLY)
    assert done.wait(2 * PROMPT) and piled == [True]
    assert len(set(overheads)) == 1 and overheads[0] > 0, overheads


def test_a_packed_reply_too_large_is_skipped_and_the_stream_goes_on():
    a, b, tx, rx = _pair()
    data = np.zeros(5 * CHUNK, np.uint8).data
    packed = codec.Chooser(CHUNK).pack([data], codec.ZSTD, 0.0)
    _send_in_thread(lambda: (tx.send(wire.REPLY, 1, b"m", (), packed=packed), tx.send(wire.PONG, 2)))
    with pytest.raises(FrameTooLarge) as info:
        rx.read_header(wire.Limits(max_buffer_bytes=CHUNK))
    rx.skip(info.value.frame)
    assert rx.read_frame(wire.Limits()).kind == wire.PONG
    a.close(), b.close()


def _raw_packed(kind: int, chunks: list[bytes], length: int) -> codec.Packed:
    import struct

    table = struct.pack(f"<{len(chunks)}I", *map(len, chunks))
    return codec.Packed([length], bytes([kind]), [[table, *chunks]], len(table) + sum(map(len, chunks)))


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([b"\x00" * 100], "does not decompress"),  # not an lz4 block of the announced size
        ([codec.compress(codec.LZ4, bytes(CHUNK // 2))], "does not decompress|instead of"),  # too short
    ],
)
def test_corrupt_compressed_data_is_a_protocol_error(chunks, message):
    a, b, tx, rx = _pair()
    _send_in_thread(tx.send, wire.REPLY, 1, b"m", (), packed=_raw_packed(codec.LZ4, chunks, CHUNK))
    frame = rx.read_frame(wire.Limits())
    with pytest.raises(ProtocolError, match=message):
        rx.read_buffers([memoryview(bytearray(CHUNK))], frame, "10.0.0.9:1")
    a.close(), b.close()


def test_a_chunk_announced_larger_than_its_data_is_refused():
    a, b, tx, rx = _pair()
    _send_in_thread(tx.send, wire.REPLY, 1, b"m", (), packed=_raw_packed(codec.LZ4, [b"x" * 200], 100))
    frame = rx.read_frame(wire.Limits())
    with pytest.raises(ProtocolError, match="compressed chunk of 200 bytes for 100 bytes"):
        rx.read_buffers([memoryview(bytearray(100))], frame, "w")
    a.close(), b.close()


# -- a worker that sends corrupt compressed data --------------------------------------------


class Sabotaged(Mixed):
    """On the first worker that builds it, every compressed chunk is replaced by garbage."""

    def __init__(self, claim: str):
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        from torchfeed.protocol import codec as worker_codec

        real = worker_codec.compress
        worker_codec.compress = lambda codec, data: b"\xff" * max(1, len(real(codec, data)))


def test_a_worker_sending_corrupt_data_is_dropped_and_nothing_is_lost(fresh_workers, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="torchfeed.workers")
    w = fresh_workers(2)
    ds = RemoteDataset(w.addresses, Sabotaged, str(tmp_path / "claim"))
    loader = RemoteDataLoader(ds, batch_size=8, compression="lz4")
    got = list(loader)
    expected = list(DataLoader(Mixed(), batch_size=8))
    assert len(got) == len(expected)
    assert all(_equal(a, b) for a, b in zip(got, expected))  # each sample once, none corrupted
    # the worker is blamed (it may be back by now: a reconnected worker leaves lost_workers())
    assert any("lz4 data that does not decompress" in r.getMessage() for r in caplog.records), caplog.text
    ds.close()


# -- statistics and advice -------------------------------------------------------------------


def test_workers_count_wire_bytes(workers2):
    ds = RemoteDataset(workers2, Mixed)
    before = [torchfeed.client.worker_stats(a) for a in workers2]
    list(RemoteDataLoader(ds, batch_size=32, compression="zstd"))
    after = [torchfeed.client.worker_stats(a) for a in workers2]
    sent = sum(x["bytes_sent"] - y["bytes_sent"] for x, y in zip(after, before))
    wired = sum(x["wire_bytes_sent"] - y["wire_bytes_sent"] for x, y in zip(after, before))
    assert 0 < wired < 0.8 * sent
    ds.close()


def _stats(**kw) -> LoaderStats:
    base = dict(
        wait_fraction=0.9,
        wait_fraction_30s=0.9,
        samples_per_s=100.0,
        batches=50,
        samples=1600,
        bytes_received=10**9,
        pass_seconds=10.0,
        wait_seconds=9.0,
    )
    return LoaderStats(**{**base, **kw})


def test_the_advice_names_a_link_bound_loader_and_float_images():
    text = advise(_stats(link_busy=0.95, wire_bytes_received=10**9, float_images=True), 50, 1.0)
    assert text.startswith("link-bound") and "uint8" in text and "normalise" in text
    text = advise(_stats(link_busy=0.95, wire_bytes_received=10**9), 50, 1.0)
    assert "compression='auto'" in text
    assert advise(_stats(link_busy=0.1), 50, 1.0).startswith("input-bound")  # workers, not the link


def test_a_buffer_whose_size_table_takes_several_records_reads_in_step(monkeypatch):
    # scaled down: 64-byte records hold 16 sizes, so a 40-chunk buffer's table takes 3 records
    from torchfeed.protocol import channel as channel_module

    monkeypatch.setattr(channel_module, "CHUNK", 64)
    monkeypatch.setattr(codec, "MIN_BYTES", 0)
    a, b, tx, rx = _pair()
    data = np.zeros(40 * 64 + 5, np.uint8)
    data[::7] = 1
    packed = codec.Chooser(64).pack([data.data], codec.LZ4, 0.0)
    assert packed is not None and packed.codecs == bytes([codec.LZ4])
    _send_in_thread(lambda: (tx.send(wire.REPLY, 1, b"m", (), packed=packed), tx.send(wire.PONG, 2)))
    frame = rx.read_frame(wire.Limits())
    dest = memoryview(bytearray(data.nbytes))
    rx.read_buffers([dest], frame, "w")
    assert bytes(dest) == data.tobytes()
    assert rx.read_frame(wire.Limits()).kind == wire.PONG
    a.close(), b.close()


def test_a_zstd_frame_announcing_more_than_its_chunk_is_refused_before_it_is_inflated():
    # zstandard would allocate what a frame announces: a few bytes can announce gigabytes
    bomb = codec.compress(codec.ZSTD, bytes(4 << 20))
    with pytest.raises(ProtocolError, match="announces 4,194,304 bytes"):
        codec.decompress_into(codec.ZSTD, bomb, memoryview(bytearray(CHUNK)), "w")
