"""Property-based fuzzing of the frame parser and the worker's handshake (100,000+ inputs)."""

from __future__ import annotations

import logging
import pickle
import random
import secrets
import socket
import struct
from typing import cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchfeed.errors import ProtocolError
from torchfeed.protocol import auth, wire
from torchfeed.worker import doorman, serverconn
from torchfeed.worker import server as worker

# Hypothesis draws an input and a seed; each example then runs that input and VARIANTS-1
# mutations of it (truncations, bit flips, insertions, extreme length fields), because
# drawing is far slower than parsing: (3,500 + 1,500) x 20 = 100,000 generated inputs.
VARIANTS = 20
PARSER_EXAMPLES = 3_500
HANDSHAKE_EXAMPLES = 1_500


def variants(data: bytes, seed: int):
    """The input and VARIANTS-1 deterministic mutations of it."""
    rng = random.Random(seed)
    yield data
    for _ in range(VARIANTS - 1):
        b = bytearray(data)
        op = rng.randrange(5)
        if op == 0 and b:
            del b[rng.randrange(len(b)) :]
        elif op == 1 and b:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 2:
            pos = rng.randint(0, len(b))
            b[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and len(b) >= 28:  # extreme meta length / buffer count in a header
            field = rng.choice([(16, 20), (20, 24)])
            b[field[0] : field[1]] = rng.choice(
                [b"\xff\xff\xff\xff", b"\x00\x00\x00\x80", b"\x01\x00\x00\x00"]
            )
        else:
            b = b + b[: rng.randint(0, len(b))]
        yield bytes(b)


class FakeSocket:
    """Feeds fixed bytes to the code under test, in small irregular pieces; records writes."""

    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.pos = 0
        self.written = 0

    def recv_into(self, buf, nbytes=0, flags=0):
        want = nbytes or len(buf)
        piece = self.data[self.pos : self.pos + min(want, 7 + self.pos % 13 if not flags else want)]
        buf[: len(piece)] = piece
        self.pos += len(piece)
        return len(piece)

    def sendmsg(self, parts):
        n = sum(memoryview(p).nbytes for p in parts)
        self.written += n
        return n

    def settimeout(self, _):
        pass

    def shutdown(self, _):
        pass

    def close(self):
        pass


header = st.builds(
    lambda kind, flags, rid, meta_len, lengths, tail, magic, version: (
        struct.pack("<4sBBHQIII", magic, version, kind, flags, rid, meta_len, len(lengths), 0)
        + b"".join(struct.pack("<Q", n) for n in lengths)
        + tail
    ),
    kind=st.integers(0, 255),
    flags=st.integers(0, 2**16 - 1),
    rid=st.integers(0, 2**64 - 1),
    meta_len=st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)),
    lengths=st.lists(st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)), max_size=6),
    tail=st.binary(max_size=200),
    magic=st.sampled_from([wire.MAGIC, wire.MAGIC, b"TFEX", b"\x00\x00\x00\x00"]),
    version=st.sampled_from([wire.VERSION, wire.VERSION, 0, 255]),
)
inputs = st.one_of(st.binary(max_size=300), header)


@pytest.mark.slow
@settings(max_examples=PARSER_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=inputs, seed=st.integers(0, 2**32))
def test_frame_parser_never_crashes_or_overallocates(data, seed):
    for variant in variants(data, seed):
        _parse_all(variant)


def _parse_all(data: bytes) -> None:
    reader = wire.FrameReader(cast(socket.socket, FakeSocket(data)))
    limits = wire.Limits(max_meta=4096, max_buffers=8, max_buffer_bytes=1 << 16)
    try:
        while True:
            frame = reader.read_frame(limits)
            # whatever got through respects the limits before anything was allocated for it
            assert len(frame.meta) <= limits.max_meta
            assert len(frame.buffer_lengths) <= limits.max_buffers
            assert sum(frame.buffer_lengths) <= limits.max_buffer_bytes
            reader.skip_buffers(frame.buffer_lengths)
    except (ProtocolError, ConnectionError):
        pass


FUZZ_SECRET = secrets.token_hex(32)


@pytest.fixture(scope="module")
def server():
    s = worker.WorkerServer(secret=FUZZ_SECRET).start()
    quiet = logging.getLogger("torchfeed.worker")
    level, quiet.level = quiet.level, logging.CRITICAL  # 50,000 rejected peers would be logged
    yield s
    quiet.setLevel(level)
    s.stop()


def _handshake_like():
    nonce = st.binary(min_size=32, max_size=32)
    auth_frame = st.builds(
        lambda body, tail: wire.pack_header(wire.AUTH, 0, len(body), []) + body + tail,
        body=st.one_of(st.binary(min_size=65, max_size=65), st.binary(max_size=600)),
        tail=st.binary(max_size=300),
    )
    call_after = st.builds(
        lambda a, b: a + wire.pack_header(wire.CALL, 1, len(b), []) + b,
        auth_frame,
        st.just(pickle.dumps(("never", "unpickled"))),
    )
    return st.one_of(st.binary(max_size=400), header, auth_frame, call_after, nonce)


@settings(
    max_examples=HANDSHAKE_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
@pytest.mark.slow
@given(data=_handshake_like(), seed=st.integers(0, 2**32))
def test_handshake_rejects_junk_without_unpickling(server, data, seed, monkeypatch_unpickle):
    hello = auth.hello_meta(False)
    for variant in variants(data, seed):
        # the doorman's verdict on what a peer sent: never "ok" without the secret, never raises
        for end in (len(variant), len(variant) // 2):
            verdict, reply, keys = doorman.judge(variant[:end], hello, server.secret)
            assert verdict in ("more", "bye", "fail") and keys is None
            assert len(reply) <= 400
    assert not monkeypatch_unpickle, "something was unpickled before authentication"


@pytest.fixture(scope="module")
def monkeypatch_unpickle():
    """Record any unpickling done by the worker's modules while the fuzzer runs."""
    calls: list[tuple] = []
    real_loads, real_loads_call = pickle.loads, serverconn.serialize.loads_call

    def spy(*a, **k):
        calls.append(a)
        return real_loads(*a, **k)

    serverconn.pickle.loads = spy

    def spy_call(*a, **k):
        calls.append(a)
        return real_loads_call(*a, **k)

    serverconn.serialize.loads_call = spy_call
    yield calls
    serverconn.pickle.loads = real_loads
    serverconn.serialize.loads_call = real_loads_call


def test_server_still_serves_after_fuzzing(server):
    import torchfeed

    got = torchfeed.rpc_async(server.address, lambda: "alive", secret=FUZZ_SECRET).wait()
    assert got == "alive"


# -- the sealed channel ---------------------------------------------------------------

KEY_A, KEY_B = b"a" * 32, b"b" * 32


class RecordingSocket(FakeSocket):
    """Keeps what is sent, to be replayed into a reader."""

    def __init__(self):
        super().__init__(b"")
        self.sent = bytearray()

    def sendmsg(self, parts):
        for p in parts:
            self.sent += memoryview(p).cast("B")
        return super().sendmsg(parts)


def sealed_stream(messages, encrypt=True) -> bytes:
    out = RecordingSocket()
    from torchfeed.protocol.channel import Channel

    chan = Channel(cast(socket.socket, out), KEY_A, KEY_B, encrypt=encrypt)
    for kind, meta, buffers in messages:
        chan.send(kind, 1, meta, buffers)
    return bytes(out.sent)


def read_all(data: bytes, encrypt=True):
    from torchfeed.protocol.channel import Channel

    chan = Channel(cast(socket.socket, FakeSocket(data)), KEY_B, KEY_A, encrypt=encrypt)
    got = []
    try:
        while True:
            frame = chan.read_frame(wire.Limits())
            bufs = [memoryview(bytearray(n)) for n in frame.buffer_lengths]
            chan.read_buffers(bufs)
            got.append((frame.kind, frame.meta, [bytes(b) for b in bufs]))
    except (ProtocolError, ConnectionError):
        pass
    return got


MESSAGES = [
    (wire.CALL, b"meta" * 100, [b"x" * 300_000, b"y" * 5]),
    (wire.PING, b"", []),
    (wire.REPLY, b"r" * 10, [bytes(range(256)) * 4]),
]


@pytest.mark.parametrize("encrypt", [True, False], ids=["encrypted", "integrity-only"])
def test_sealed_stream_round_trip_and_every_mutation_is_caught(encrypt):
    """Any truncation, bit flip, insertion or repeat of a sealed stream yields only the
    messages before the damage, each exactly as sent: never an altered one."""
    stream = sealed_stream(MESSAGES, encrypt)
    assert read_all(stream, encrypt) == [(k, m, [bytes(b) for b in bs]) for k, m, bs in MESSAGES]
    if encrypt:
        assert b"meta" not in stream and b"x" * 64 not in stream  # nothing in clear
    for seed in range(300):
        mutated = list(variants(stream, seed))[1:]
        for m in mutated:
            got = read_all(m, encrypt)
            assert got == [(k, mm, [bytes(b) for b in bs]) for k, mm, bs in MESSAGES][: len(got)]
            if m != stream and len(m) == len(stream):  # a flipped bit: the damaged message is lost
                assert len(got) < len(MESSAGES)


def test_sealed_records_cannot_be_reordered_replayed_or_reflected():
    one = sealed_stream([(wire.PING, b"", [])])
    two = sealed_stream([(wire.PING, b"", []), (wire.CALL, b"m", [])])
    second_only = two[len(one) :]
    assert read_all(second_only) == []  # record counter: out of order
    assert len(read_all(one + one)) == 1  # replayed: the copy fails
    from torchfeed.protocol.channel import Channel

    reflected = Channel(cast(socket.socket, FakeSocket(one)), KEY_A, KEY_B)  # our own traffic sent back to us
    with pytest.raises(ProtocolError):
        reflected.read_frame(wire.Limits())
