"""Security of the data plane, against real worker processes on 127.0.0.1.

Covers mutual authentication (wrong secret, impostor worker, replay), the rule that
nothing is unpickled before the peer proved the secret, robustness against malformed
frames before and inside the sealed channel (the worker drops that connection, allocates
nothing and keeps serving), the handshake timeout, and secret discovery and its rules.
Attacks by an on-path relay, floods and stalled clients are in test_attacks.py.
"""

from __future__ import annotations

import base64
import os
import pickle
import secrets
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

import torchfeed
from helpers import PROMPT, named_workers_fixtures, wait_for
from torchfeed import client
from torchfeed.protocol import auth, replies, serialize, strength, wire

pytestmark = pytest.mark.timeout(60)

SECRET = os.environ.get("TORCHFEED_SECRET", "")  # conftest.py's; workers importing this module have none
WRONG = secrets.token_hex(32)


# -- helpers ------------------------------------------------------------------


def split(address: str):
    host, port = client.parse_address(address)
    return host, port


def raw_connect(address: str, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(split(address), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def raw_client(address: str, secret: str = SECRET, timeout: float = 5.0):
    """A raw socket that completed the client handshake; returns (sock, sealed channel)."""
    sock = raw_connect(address, timeout)
    return sock, auth.client_handshake(sock, auth.load_secret(secret), address)


def auth_meta(
    sock: socket.socket, secret: str, hello: bytes, cnonce: bytes, mode: int = auth.MODE_ENCRYPTED
) -> bytes:
    """An AUTH message's meta for a client connected with ``sock`` (the endpoint it dialled)."""
    dialled = auth.pack_endpoint(sock.getpeername())
    proof = auth.handshake_proof(secret.encode(), b"client", hello, cnonce, mode, dialled)
    return cnonce + bytes([mode]) + dialled + proof


def read_hello(sock: socket.socket, reader: wire.FrameReader) -> bytes:
    frame = reader.read_frame(wire.HANDSHAKE_LIMITS)
    assert frame.kind == wire.HELLO and len(frame.meta) == auth.HELLO_BYTES
    return frame.meta


def wait_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Read until the peer closes the connection; return what was received.

    Fails if the connection is still open after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the worker kept the connection open for {timeout} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError:
            raise AssertionError(f"the worker kept the connection open for {timeout} s") from None
        if not chunk:
            return data
        data += chunk


def parse_frames(data: bytes):
    """Split received bytes into (kind, meta) pairs (buffers are not expected here)."""
    out = []
    while len(data) >= wire.HEADER.size:
        magic, _v, kind, _f, _rid, meta_len, nbuf, _ = wire.HEADER.unpack_from(data)
        assert magic == wire.MAGIC
        start = wire.HEADER.size + 8 * nbuf
        out.append((kind, data[start : start + meta_len]))
        data = data[start + meta_len :]
    return out


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS line")


def assert_serves(address: str, pid: int, secret: str = SECRET) -> None:
    """The worker process ``pid`` at ``address`` still answers a normal client."""
    assert torchfeed.rpc_async(address, os.getpid, timeout=10, secret=secret).wait() == pid
    assert (
        torchfeed.rpc_async(address, lambda a, b: a * b, args=(6, 7), timeout=10, secret=secret).wait() == 42
    )


class Marker:
    """Unpickling this creates the file at ``path`` (proof that something was unpickled)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def evil_call_meta(path: Path) -> bytes:
    # Shaped like a real CALL payload: (func, args, kwargs), the func being the trap.
    return pickle.dumps((Marker(str(path)), (), {}), protocol=5)


SHARED_FILE_SECRET = secrets.token_hex(32)


def _specs(tmp_path_factory) -> dict:
    """This module's private workers, started concurrently."""
    secret_file = tmp_path_factory.mktemp("secret") / "shared-secret"
    write_secret(secret_file, SHARED_FILE_SECRET + "\n")
    return {
        "main": {},
        # gives new connections one second to authenticate
        "quick": {"extra_args": ["--handshake-timeout", "1"]},
        # finds its secret through TORCHFEED_SECRET_FILE only
        "file": {"env": {auth.ENV_SECRET: "", auth.ENV_SECRET_FILE: str(secret_file)}},
    }


_workers, worker = named_workers_fixtures(_specs)


@pytest.fixture
def quick_worker(_workers):
    return _workers["quick"]


@pytest.fixture
def file_worker(_workers):
    return _workers["file"]


# -- authentication -----------------------------------------------------------


def test_wrong_secret_is_rejected_with_a_hint(worker):
    address, pid = worker
    fut = torchfeed.rpc_async(address, os.getpid, secret=WRONG, timeout=PROMPT)
    with pytest.raises(torchfeed.AuthenticationError) as info:  # refused, not timed out
        fut.wait()
    message = str(info.value)
    assert "TORCHFEED_SECRET" in message
    assert address in message
    assert WRONG not in message  # the secret itself is never shown
    # the low-level entry point raises directly
    with pytest.raises(torchfeed.AuthenticationError, match="TORCHFEED_SECRET"):
        client.connect(address, secret=WRONG.encode(), timeout=10)
    assert_serves(address, pid)


def test_wrong_secret_does_not_poison_the_right_connection(worker):
    address, pid = worker
    assert_serves(address, pid)
    for _ in range(3):
        with pytest.raises(torchfeed.AuthenticationError):
            torchfeed.rpc_async(address, os.getpid, secret=WRONG, timeout=10).wait()
        assert_serves(address, pid)


class FakeWorker:
    """A plain socket server speaking just enough of the protocol to impersonate a worker.

    ``reply(sock, reader, hello, auth_meta)`` answers the client's AUTH message.
    """

    def __init__(self, reply):
        self.reply = reply
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.errors = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        with sock:
            try:
                reader = wire.FrameReader(sock)
                hello = auth.hello_meta(False)
                wire.send_frame(sock, wire.HELLO, meta=hello)
                frame = reader.read_frame(wire.HANDSHAKE_LIMITS)
                assert frame.kind == wire.AUTH
                self.reply(sock, reader, hello, frame.meta)
                sock.settimeout(5)
                while sock.recv(4096):  # keep it open until the client hangs up
                    pass
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)

    def close(self):
        self.listener.close()
        self.thread.join(10)


@pytest.fixture
def fake_worker():
    made = []

    def make(reply):
        made.append(FakeWorker(reply))
        return made[-1]

    yield make
    for f in made:
        f.close()


def test_impostor_worker_is_detected(fake_worker):
    """A 'worker' that does not know the secret cannot produce a valid AUTH_OK."""
    fake = fake_worker(lambda sock, r, wn, meta: wire.send_frame(sock, wire.AUTH_OK, meta=os.urandom(32)))
    with pytest.raises(torchfeed.AuthenticationError) as info:  # refused, not timed out
        client.connect(fake.address, timeout=PROMPT)
    assert "could not prove" in str(info.value)
    assert "TORCHFEED_SECRET" in str(info.value)
    assert fake.address not in {c.address for c in client.default_session().connections()}


def test_impostor_worker_through_rpc_async(fake_worker):
    fake = fake_worker(lambda sock, r, wn, meta: wire.send_frame(sock, wire.AUTH_OK, meta=os.urandom(32)))
    with pytest.raises(torchfeed.AuthenticationError):
        torchfeed.rpc_async(fake.address, os.getpid, timeout=5).wait()


def test_worker_proof_is_bound_to_the_client_nonce(fake_worker):
    """A worker that replays the client's own proof (reflection) is rejected."""
    fake = fake_worker(
        lambda sock, r, wn, meta: wire.send_frame(sock, wire.AUTH_OK, meta=meta[-auth.MAC_BYTES :])
    )
    with pytest.raises(torchfeed.AuthenticationError):
        client.connect(fake.address, timeout=5)


def test_worker_that_knows_the_secret_is_accepted_by_the_fake_setup(fake_worker):
    """Control for the impostor tests: the same fake server with a correct proof passes."""

    def honest(sock, reader, hello, meta):
        cnonce, mode, dialled = meta[: auth.NONCE_BYTES], meta[auth.NONCE_BYTES], auth.dialled_of(meta)
        proof = auth.handshake_proof(SECRET.encode(), b"worker", hello, cnonce, mode, dialled)
        wire.send_frame(sock, wire.AUTH_OK, meta=proof)

    fake = fake_worker(honest)
    sock = raw_connect(fake.address)
    try:
        channel = auth.client_handshake(sock, auth.load_secret(SECRET), fake.address)
        assert channel.encrypt
    finally:
        sock.close()


def test_auth_fail_from_worker_raises_authentication_error(fake_worker):
    fake = fake_worker(lambda sock, r, wn, meta: wire.send_frame(sock, wire.AUTH_FAIL, meta=b"wrong secret"))
    with pytest.raises(torchfeed.AuthenticationError, match="TORCHFEED_SECRET"):
        client.connect(fake.address, timeout=5)


def test_replayed_auth_message_is_rejected(worker):
    """A recorded AUTH message is useless in a new session (fresh worker nonce)."""
    address, pid = worker
    sock = raw_connect(address)
    reader = wire.FrameReader(sock)
    hello = read_hello(sock, reader)
    recorded = auth_meta(sock, SECRET, hello, os.urandom(32))
    wire.send_frame(sock, wire.AUTH, meta=recorded)
    assert reader.read_frame(wire.HANDSHAKE_LIMITS).kind == wire.AUTH_OK
    sock.close()

    sock = raw_connect(address)
    reader = wire.FrameReader(sock)
    read_hello(sock, reader)
    wire.send_frame(sock, wire.AUTH, meta=recorded)
    assert reader.read_frame(wire.HANDSHAKE_LIMITS).kind == wire.AUTH_FAIL
    wait_closed(sock)
    sock.close()
    assert_serves(address, pid)


# -- nothing is unpickled before authentication ---------------------------------


def test_marker_payload_is_effective_after_authentication(worker, tmp_path):
    """Control: the trap payload does create the file when a worker unpickles it."""
    address, pid = worker
    marker = tmp_path / "unpickled-after-auth"
    sock, chan = raw_client(address)
    try:
        chan.send(wire.CALL, 1, meta=evil_call_meta(marker))
        frame = chan.read_frame(wire.Limits())
        assert frame.kind == wire.ERROR  # the "function" is a file object: not callable
        assert frame.request_id == 1
    finally:
        sock.close()
    assert wait_for(marker.exists)


def _no_handshake(sock: socket.socket, reader: wire.FrameReader) -> int | None:
    return None


def _wrong_secret(sock: socket.socket, reader: wire.FrameReader) -> int | None:
    hello = read_hello(sock, reader)
    wire.send_frame(sock, wire.AUTH, meta=auth_meta(sock, WRONG, hello, os.urandom(32)))
    return wire.AUTH_FAIL  # pipelined: the CALL is sent before the verdict arrives


def _garbage_auth(sock: socket.socket, reader: wire.FrameReader) -> int | None:
    read_hello(sock, reader)
    wire.send_frame(sock, wire.AUTH, meta=b"x" * 10)  # wrong length
    return None


@pytest.mark.parametrize(
    "prelude, padding",
    [(_no_handshake, 0), (_no_handshake, 4096), (_wrong_secret, 0), (_garbage_auth, 0)],
    ids=["no-handshake-small-meta", "no-handshake-oversized-meta", "wrong-secret", "garbage-auth"],
)
def test_call_without_a_good_handshake_is_not_unpickled(worker, tmp_path, prelude, padding):
    """A CALL sent after ``prelude`` (what the client sent of a handshake, returning the frame
    the worker answers it with, if any) is never unpickled: the worker closes the connection
    and serves on."""
    address, pid = worker
    marker = tmp_path / "unpickled"
    sock = raw_connect(address)
    reader = wire.FrameReader(sock)
    try:
        verdict = prelude(sock, reader)
        wire.send_frame(sock, wire.CALL, 1, meta=evil_call_meta(marker) + b"\x00" * padding)
        if verdict is not None:
            assert reader.read_frame(wire.HANDSHAKE_LIMITS).kind == verdict
        wait_closed(sock)
    finally:
        sock.close()
    assert_serves(address, pid)  # runs through the same executor after any queued work
    assert not marker.exists()


# -- malformed frames ------------------------------------------------------------

H = wire.HEADER


def header(kind=wire.CALL, meta_len=0, nbuf=0, magic=wire.MAGIC, version=wire.VERSION, rid=1):
    return H.pack(magic, version, kind, 0, rid, meta_len, nbuf, 0)


MALFORMED = {
    "junk": os.urandom(4096),
    "ascii-junk": b"GET / HTTP/1.1\r\nHost: example.org\r\nAccept: */*\r\n\r\n",
    "bad-magic": header(magic=b"XXXX"),
    "bad-version": header(version=wire.VERSION + 1),
    "unknown-kind-0": header(kind=0),
    "unknown-kind-99": header(kind=99),
    "unknown-kind-255": header(kind=255),
    "meta-2**32-1": header(meta_len=2**32 - 1),
    "meta-over-limit": header(meta_len=wire.Limits().max_meta + 1),
    "buffers-2**32-1": header(nbuf=2**32 - 1),
    "buffers-over-limit": header(nbuf=wire.Limits().max_buffers + 1),
    "buffer-len-2**64-1": header(nbuf=1) + struct.pack("<Q", 2**64 - 1),
    "buffer-lens-sum-over-limit": header(nbuf=2) + struct.pack("<2Q", 2**63, 2**63),
    "buffer-lens-many-large": header(nbuf=3) + struct.pack("<3Q", *[wire.Limits().max_buffer_bytes // 2] * 3),
    "truncated-header": header()[:10],
    "truncated-lengths": header(nbuf=4) + b"\x01\x00\x00",
    "truncated-meta": header(meta_len=1000) + b"\x80\x05" + b"x" * 10,
    "truncated-buffer": header(meta_len=4, nbuf=1) + struct.pack("<Q", 1 << 20) + b"abcd" + b"y" * 100,
    "worker-kind-REPLY": header(kind=wire.REPLY),
    "worker-kind-HELLO": header(kind=wire.HELLO, meta_len=32) + b"n" * 32,
    "worker-kind-AUTH_OK": header(kind=wire.AUTH_OK, meta_len=32) + b"p" * 32,
    "worker-kind-BYE": header(kind=wire.BYE),
    "worker-kind-PONG": header(kind=wire.PONG),
}

# what must be answered with a BYE naming the problem (frame fully consumed: no RST)
BYE_TEXT = {"bad-version": "version", "unknown-kind-99": "unknown message kind"}


def send_malformed(address: str, name: str, stage: str):
    """Open a connection, get it to ``stage`` and send MALFORMED[name]; return the socket.

    Stages: ``before-auth`` (raw bytes instead of AUTH), ``after-auth-raw`` (raw bytes
    inside the sealed stream: they fail authentication) and ``after-auth-sealed`` (the same
    header and rest, properly sealed: the worker must judge their content).
    """
    payload = MALFORMED[name]
    if stage == "before-auth":
        sock = raw_connect(address)
        read_hello(sock, wire.FrameReader(sock))
        parts = [payload]
    else:
        sock, chan = raw_client(address)
        parts = [payload]
        if stage == "after-auth-sealed":
            head, rest = payload[: wire.HEADER.size], payload[wire.HEADER.size :]
            chan.send_record(head)
            if rest:
                chan.send_record(rest)
            parts = []
    try:
        for part in parts:
            sock.sendall(part)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker may already have hung up on the first bytes
    return sock


@pytest.mark.parametrize("stage", ["before-auth", "after-auth-raw", "after-auth-sealed"])
@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_frame_drops_only_that_connection(worker, name, stage):
    address, pid = worker
    bystander = client.connect(address, timeout=10)  # an established client must survive
    rss_before = rss_mb(pid)
    sock = send_malformed(address, name, stage)
    try:
        # inside the sealed stream a partial record just waits for the rest: hang up
        if name.startswith("truncated") or stage != "before-auth":
            try:
                sock.shutdown(socket.SHUT_WR)  # the peer vanishes mid-frame
            except OSError:
                pass
        data = wait_closed(sock)
    finally:
        sock.close()
    if name in BYE_TEXT and data and stage == "before-auth":
        frames = parse_frames(data)
        assert frames[-1][0] == wire.BYE
        assert BYE_TEXT[name] in frames[-1][1].decode()
    assert rss_mb(pid) - rss_before < 100, "the worker allocated for a malformed frame"
    assert not bystander.closed
    assert_serves(address, pid)
    assert client.connect(address) is bystander


def test_bad_version_is_answered_with_bye(worker):
    address, pid = worker
    sock = raw_connect(address)
    reader = wire.FrameReader(sock)
    read_hello(sock, reader)
    sock.sendall(header(version=wire.VERSION + 1))
    frame = reader.read_frame(wire.HANDSHAKE_LIMITS)
    assert frame.kind == wire.BYE
    assert b"same torchfeed version" in frame.meta
    wait_closed(sock)
    sock.close()


def test_unpicklable_call_after_auth_fails_that_request_only(worker):
    address, pid = worker
    sock, chan = raw_client(address)
    try:
        chan.send(wire.CALL, 7, meta=b"\x80\x05not a pickle at all")
        frame = chan.read_frame(wire.Limits())
        assert (frame.kind, frame.request_id) == (wire.ERROR, 7)
        info = pickle.loads(frame.meta)
        assert "Unpickling" in info["type"] or "pickle" in info["traceback"].lower()
        # the same connection goes on working
        meta, bufs = serialize.dumps((os.getpid, (), {}), by_value=True)
        chan.send(wire.CALL, 8, meta=meta, buffers=bufs)
        frame = chan.read_frame(wire.Limits())
        assert (frame.kind, frame.request_id) == (wire.REPLY, 8)
        assert replies.SAFE.loads(frame.meta) == pid
        sock.settimeout(5)
        chan.send(wire.PING, 9)
        assert chan.read_frame(wire.Limits()).kind == wire.PONG
    finally:
        sock.close()


def test_many_bad_peers_at_once(worker):
    address, pid = worker
    socks = [raw_connect(address) for _ in range(30)]
    for i, s in enumerate(socks):
        s.sendall(os.urandom(64) if i % 2 else header(kind=99))
    for s in socks:
        wait_closed(s)
        s.close()
    assert_serves(address, pid)


# -- handshake timeout --------------------------------------------------------------


def test_silent_peer_is_dropped_after_handshake_timeout(quick_worker):
    address, pid = quick_worker
    socks = [raw_connect(address) for _ in range(10)]
    start = time.monotonic()
    for s in socks:
        data = wait_closed(s, timeout=PROMPT)
        assert parse_frames(data)[0][0] == wire.HELLO
    assert time.monotonic() - start > 0.5  # after the handshake timeout, not at once
    for s in socks:
        s.close()
    assert_serves(address, pid)


def test_slow_handshake_is_dropped(quick_worker):
    """A peer dribbling bytes never gets more than the handshake timeout."""
    address, pid = quick_worker
    sock = raw_connect(address)
    reader = wire.FrameReader(sock)
    read_hello(sock, reader)
    start = time.monotonic()
    frame = header(kind=wire.AUTH, meta_len=auth.AUTH_BYTES) + b"z" * auth.AUTH_BYTES
    closed = False
    for byte in frame:
        try:
            sock.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        sock.settimeout(0.3)
        try:
            if sock.recv(1) == b"":
                closed = True
                break
        except TimeoutError:
            continue
        except ConnectionResetError:
            closed = True
            break
        if time.monotonic() - start > PROMPT:
            break
    sock.close()
    # a timeout per byte would have let the whole frame through: it bounds the whole handshake
    assert closed, f"the worker kept a dribbling peer for {PROMPT:g} s"
    assert_serves(address, pid)


def test_authenticated_client_is_not_hit_by_handshake_timeout(quick_worker):
    """The handshake timeout does not apply once the client is authenticated."""
    address, pid = quick_worker
    sock, chan = raw_client(address)
    try:
        time.sleep(1.6)  # longer than the handshake timeout: the point of the test
        meta, bufs = serialize.dumps((os.getpid, (), {}), by_value=True)
        chan.send(wire.CALL, 1, meta=meta, buffers=bufs)
        frame = chan.read_frame(wire.Limits())
        assert frame.kind == wire.REPLY
        assert replies.SAFE.loads(frame.meta) == pid
    finally:
        sock.close()


# -- secret discovery ------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No secret in the environment, an empty XDG_CONFIG_HOME and an empty discovery cache."""
    monkeypatch.delenv(auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(auth.ENV_SECRET_FILE, raising=False)
    config = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.setattr(auth, "_discovered", {})
    return config


def write_secret(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_env_secret_wins_over_file(clean_env, monkeypatch, tmp_path):
    from_env, from_file = secrets.token_hex(32), secrets.token_hex(32)
    monkeypatch.setenv(auth.ENV_SECRET, from_env)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(write_secret(tmp_path / "s", from_file)))
    secret = auth.load_secret()
    assert secret.value == from_env.encode()
    assert auth.ENV_SECRET in secret.source
    # an unusable file does not matter when the variable is set
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(tmp_path / "missing"))
    assert auth.load_secret().value == from_env.encode()
    assert from_env not in repr(secret)


def test_secret_file_is_read(clean_env, monkeypatch, tmp_path):
    value = secrets.token_urlsafe(32)
    path = write_secret(tmp_path / "secret", f"  {value} \n")
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(path))
    secret = auth.load_secret()
    assert secret.value == value.encode()
    assert str(path) in secret.source
    assert not (clean_env / "torchfeed" / "secret").exists()  # no default file made


def test_binary_secret_file_is_read_as_it_is(clean_env, monkeypatch, tmp_path):
    # raw random bytes may begin or end with a whitespace byte: they are not stripped
    for edge in (b" ", b"\n", b"\t", b"\r\n"):
        value = b"\xff" + secrets.token_bytes(30) + edge
        path = tmp_path / "binary"
        path.write_bytes(value)
        os.chmod(path, 0o600)
        monkeypatch.setattr(auth, "_discovered", {})
        monkeypatch.setenv(auth.ENV_SECRET_FILE, str(path))
        assert auth.load_secret().value == value == auth.load_secret(value).value


def test_a_process_that_adopted_its_secret_hands_it_to_its_local_workers(clean_env, tmp_path):
    # a worker (or a Dask worker after start_workers) holds its secret outside its environment
    script = (
        "import secrets, torchfeed\n"
        "from torchfeed.protocol import auth\n"
        "value = secrets.token_hex(32)\n"
        "auth.adopt_secret(auth.load_secret(value))\n"
        "with torchfeed.LocalWorkers(1) as w:\n"
        "    print(torchfeed.rpc_async(w.addresses[0], sum, args=([1, 2],), secret=value).wait())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (auth.ENV_SECRET, auth.ENV_SECRET_FILE)}
    env["XDG_CONFIG_HOME"] = str(clean_env)  # the workers' default file would be another secret
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.strip() == "3", done.stderr[-2000:]


def test_empty_env_secret_falls_back_to_the_file(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv(auth.ENV_SECRET, "")
    value = secrets.token_hex(32)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(write_secret(tmp_path / "s", value)))
    assert auth.load_secret().value == value.encode()


def test_default_file_is_created_private(clean_env):
    old_umask = os.umask(0)  # even a permissive umask must not widen the mode
    try:
        secret = auth.load_secret()
    finally:
        os.umask(old_umask)
    path = clean_env / "torchfeed" / "secret"
    assert path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0
    text = path.read_text().strip()
    assert len(bytes.fromhex(text)) == 32  # 64 hex digits
    assert secret.value == text.encode()
    assert str(path) in secret.source
    # found again (not regenerated) by a later discovery
    auth._discovered.clear()
    assert auth.load_secret().value == secret.value
    assert auth.default_secret_path() == path


def test_default_path_without_xdg(clean_env, monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert auth.default_secret_path() == tmp_path / "home" / ".config" / "torchfeed" / "secret"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_readable_secret_file_is_refused(clean_env, monkeypatch, tmp_path, mode):
    path = write_secret(tmp_path / "secret", secrets.token_hex(32), mode)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(path))
    with pytest.raises(torchfeed.AuthenticationError, match="chmod 600") as info:
        auth.load_secret()
    assert str(path) in str(info.value)


def test_readable_default_file_is_refused(clean_env):
    path = clean_env / "torchfeed" / "secret"
    path.parent.mkdir(parents=True)
    write_secret(path, secrets.token_hex(32), 0o644)
    with pytest.raises(torchfeed.AuthenticationError, match="chmod 600"):
        auth.load_secret()


def test_missing_secret_file(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(tmp_path / "nope"))
    with pytest.raises(torchfeed.AuthenticationError, match="does not exist"):
        auth.load_secret()


SHORT = "hunter2-is-not-a-secret"  # 23 bytes


def _loading_from(source: str, text: str, monkeypatch, tmp_path):
    """A call that loads ``text`` as the secret from ``source`` (the environment, a file, an argument)."""
    if source == "env":
        monkeypatch.setenv(auth.ENV_SECRET, text)
        return auth.load_secret
    if source == "file":
        monkeypatch.setenv(auth.ENV_SECRET_FILE, str(write_secret(tmp_path / "given", text + "\n")))
        return auth.load_secret
    value: dict[str, str | bytes | auth.Secret] = {
        "argument-str": text,
        "argument-bytes": text.encode(),
        "Secret": auth.Secret(text.encode(), "test"),
    }
    return lambda: auth.load_secret(value[source])


@pytest.mark.parametrize("source", ["env", "file", "argument-str", "argument-bytes", "Secret"])
def test_short_secrets_are_refused_from_every_source(clean_env, monkeypatch, tmp_path, source):
    with pytest.raises(torchfeed.AuthenticationError) as info:
        _loading_from(source, SHORT, monkeypatch, tmp_path)()
    message = str(info.value)
    assert "at least 32" in message and "secrets.token_hex(32)" in message
    assert SHORT not in message


def test_a_short_secret_cannot_start_a_worker_or_a_client(worker):
    address, _pid = worker
    with pytest.raises(torchfeed.AuthenticationError, match="at least 32"):
        torchfeed.WorkerServer(secret=SHORT)
    with pytest.raises(torchfeed.AuthenticationError, match="at least 32"):
        torchfeed.rpc_async(address, os.getpid, secret=SHORT, timeout=5).wait()


WEAK = {  # the red team's examples (the first one was the docs' own) and two cousins
    "hex-alphabet-4-times": "0123456789abcdef" * 4,
    "one-letter": "a" * 32,
    "word-4-times": "password" * 4,
    "word-4-times-and-a-digit": "password" * 4 + "1",
    "alphabet-run": "abcdefghijklmnopqrstuvwxyz012345",
    "two-characters": "ab" * 20,
}


@pytest.mark.parametrize("source", ["env", "file", "argument-str", "argument-bytes", "Secret"])
@pytest.mark.parametrize("weak", list(WEAK.values()), ids=list(WEAK))
def test_weak_secrets_are_refused_from_every_source(clean_env, monkeypatch, tmp_path, source, weak):
    """Long enough, but guessable: few characters, a repeated block, runs like 'abcd'."""
    with pytest.raises(torchfeed.AuthenticationError) as info:
        _loading_from(source, weak, monkeypatch, tmp_path)()
    message = str(info.value)
    assert "too easy to guess" in message and "secrets.token_hex(32)" in message, message
    assert weak not in message and weak[:8] not in message  # it says what is wrong, not the value


def test_weak_secret_messages_say_what_is_wrong():
    def why(value: str) -> str:
        with pytest.raises(torchfeed.AuthenticationError) as info:
            auth.load_secret(value)
        return str(info.value)

    assert "only 1 different character" in why("a" * 32)
    assert "repeats one block of 16 characters" in why("0123456789abcdef" * 4)
    assert "repeats one block of 8 characters" in why("password" * 4)
    assert "runs like 'abcd'" in why("abcdefghijklmnopqrstuvwxyz012345")


RANDOM_KINDS: dict[str, Callable[[], str | bytes]] = {
    "token_hex(16)": lambda: secrets.token_hex(16),
    "token_hex(32)": lambda: secrets.token_hex(32),
    "token_hex(64)": lambda: secrets.token_hex(64),
    "token_urlsafe(24)": lambda: secrets.token_urlsafe(24),
    "token_urlsafe(32)": lambda: secrets.token_urlsafe(32),
    "token_bytes(32)": lambda: secrets.token_bytes(32),
    "b64encode(token_bytes(24))": lambda: base64.b64encode(secrets.token_bytes(24)),
    "b64encode(token_bytes(32))": lambda: base64.b64encode(secrets.token_bytes(32)).decode(),
    "str(randbits(128))": lambda: str(secrets.randbits(128)).rjust(32, "0"),
    "token_hex(16).upper()": lambda: secrets.token_hex(16).upper(),
}


@pytest.mark.parametrize("kind", list(RANDOM_KINDS))
def test_random_secrets_always_pass(kind):
    """Thousands of draws of every usual way to make a secret: none refused, all far from the bar.

    In 100,000 draws of each kind the lowest estimate seen was 96 bits for token_hex(16) (the
    shortest: 32 characters of 4 bits) and for str(randbits(128)), and 156 or more for the
    others; the bar is 64 bits. Fewer than 6 different characters in token_hex(16) has
    probability 3e-13.
    """
    make = RANDOM_KINDS[kind]
    lowest = float("inf")
    for _ in range(3000):
        value = make()
        assert auth.load_secret(value).value == (value if isinstance(value, bytes) else value.encode())
        raw = value if isinstance(value, bytes) else value.encode()
        lowest = min(lowest, strength.estimated_bits(raw))
    assert lowest >= strength.MIN_ESTIMATED_BITS + 16, f"{kind}: lowest estimate {lowest:.0f} bits"


def test_default_secret_files_always_pass(clean_env):
    """The per-user default file torchfeed makes (token_hex(32)) is accepted, every time."""
    path = clean_env / "torchfeed" / "secret"
    values = set()
    for _ in range(200):
        if path.exists():
            path.unlink()
        auth._discovered.clear()
        values.add(auth.load_secret().value)
    assert len(values) == 200 and all(len(v) == 64 for v in values)


def test_explicit_secret_types():
    long = secrets.token_hex(16)
    assert auth.load_secret(long).value == long.encode()
    assert auth.load_secret(long.encode()).value == long.encode()
    s = auth.Secret(long.encode(), "test")
    assert auth.load_secret(s) == s
    with pytest.raises(TypeError):
        auth.load_secret(123)  # type: ignore[arg-type]  # not a secret: refused


def test_symlinked_secret_file_is_refused(clean_env, monkeypatch, tmp_path):
    target = write_secret(tmp_path / "real", secrets.token_hex(32))
    link = tmp_path / "link"
    link.symlink_to(target)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(link))
    with pytest.raises(torchfeed.AuthenticationError, match="symbolic link"):
        auth.load_secret()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_secret_file_of_another_user_is_refused(clean_env, monkeypatch, tmp_path):
    path = write_secret(tmp_path / "theirs", secrets.token_hex(32))
    os.chown(path, 65534, 65534)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(path))
    with pytest.raises(torchfeed.AuthenticationError, match="not to you"):
        auth.load_secret()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_secret_in_a_directory_others_can_write_is_refused(clean_env, monkeypatch, tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    path = write_secret(shared / "secret", secrets.token_hex(32))
    os.chmod(shared, mode)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(path))
    with pytest.raises(torchfeed.AuthenticationError, match="can be written by other users"):
        auth.load_secret()


@pytest.mark.slow
def test_default_file_created_concurrently_is_never_seen_half_written(clean_env):
    """Many processes creating the default secret at once all read the same full value."""
    import subprocess
    import sys

    code = "from torchfeed.protocol import auth; print(auth.load_secret().value.decode())"
    env = {k: v for k, v in os.environ.items() if k not in (auth.ENV_SECRET, auth.ENV_SECRET_FILE)}
    path = clean_env / "torchfeed" / "secret"
    for _round in range(3):
        if path.exists():
            path.unlink()
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(8)
        ]
        outs = [p.communicate(timeout=60) for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
        values = {o[0].strip() for o in outs}
        assert len(values) == 1 and len(values.pop()) == 64
        assert [f.name for f in path.parent.iterdir()] == ["secret"]  # no temp files left


def test_worker_and_client_share_a_secret_file(file_worker):
    """End to end: a worker reading TORCHFEED_SECRET_FILE talks only to holders of that secret."""
    address, pid = file_worker
    assert_serves(address, pid, secret=SHARED_FILE_SECRET)
    with pytest.raises(torchfeed.AuthenticationError):
        torchfeed.rpc_async(address, os.getpid, timeout=10).wait()  # the session's secret


# -- the session keys ---------------------------------------------------------------------


def _handshake_pair(secret: str = SECRET):
    """A client channel and a worker channel over a socketpair, keyed by a real handshake."""
    from torchfeed.worker import doorman

    c, w = socket.socketpair()
    hello = auth.hello_meta(False)
    wire.send_frame(w, wire.HELLO, meta=hello)
    result: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: result.update(chan=auth.client_handshake(c, auth.load_secret(secret), "pair"))
    )
    t.start()
    received = b""
    while len(received) < wire.HEADER.size + auth.AUTH_BYTES:
        received += w.recv(4096)
    verdict, reply, keys = doorman.judge(received, hello, auth.load_secret(secret))
    assert verdict == "ok"
    wire.send_frame(w, wire.AUTH_OK, meta=reply)
    t.join(10)
    return c, w, result["chan"], keys


def test_keys_differ_per_direction_and_per_connection():
    c1, w1, client1, worker_keys1 = _handshake_pair()
    c2, w2, client2, worker_keys2 = _handshake_pair()
    try:
        assert worker_keys1.send != worker_keys1.recv  # one key per direction
        assert {worker_keys1.send, worker_keys1.recv}.isdisjoint({worker_keys2.send, worker_keys2.recv})
        worker1 = worker_keys1.channel(w1)
        client1.send(wire.CALL, 5, meta=b"hello")
        frame = worker1.read_frame(wire.Limits())
        assert (frame.kind, frame.request_id, frame.meta) == (wire.CALL, 5, b"hello")
    finally:
        for s in (c1, w1, c2, w2):
            s.close()


@pytest.mark.slow
def test_reflected_records_are_rejected():
    """A relay that sends a side's own sealed records back to it gets nothing through."""
    from torchfeed.protocol.channel import Channel

    c, w, client_chan, worker_keys = _handshake_pair()
    try:
        out: list[bytes] = []

        class Tap:  # records what the client sends
            def sendmsg(self, parts):
                out.extend(bytes(memoryview(p).cast("B")) for p in parts)
                return sum(len(x) for x in out[-len(parts) :])

        tap = Channel(
            cast(socket.socket, Tap()), worker_keys.recv, worker_keys.send
        )  # the client's keys, as derived
        tap.send(wire.PING, 1)
        reflected = socket.socketpair()
        reflected[0].sendall(b"".join(out))
        reflected[0].close()
        as_client = Channel(reflected[1], worker_keys.recv, worker_keys.send)  # the client reading it
        with pytest.raises(torchfeed.ProtocolError, match="authentication"):
            as_client.read_frame(wire.Limits())
        reflected[1].close()
    finally:
        c.close()
        w.close()


def test_a_worker_of_an_older_wire_version_is_refused_at_the_handshake_with_a_clear_message():
    """Pickles name module paths (torchfeed.worker.fetch, ...), which moved between versions:
    a trainer meeting a worker of the previous version must fail at its first frame, naming both."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    address = f"127.0.0.1:{server.getsockname()[1]}"

    def old_worker():
        conn, _ = server.accept()
        with conn:
            conn.sendall(
                header(kind=wire.HELLO, meta_len=len(auth.hello_meta(False)), version=wire.VERSION - 1)
            )
            conn.sendall(auth.hello_meta(False))
            conn.recv(1024)

    thread = threading.Thread(target=old_worker, daemon=True)
    thread.start()
    try:
        with pytest.raises(
            torchfeed.ProtocolError,
            match=rf"version {wire.VERSION - 1}, this side speaks {wire.VERSION}.*same torchfeed version",
        ):
            client.Connection(address, auth.load_secret(SECRET), 5, session=client.default_session())
    finally:
        server.close()
        thread.join(5)
