"""Attacks on real workers: an on-path relay, wire captures, floods, stalled clients.

The relay (tests/relay.py) sits between trainer and worker without the secret, as a
spoofed host name or a forged line in a workers file would put it. It can forward the
handshake, but every byte after it is sealed: tampering, replaying and injecting only
close that connection, and the loader finishes the epoch with every sample exactly once.
"""

from __future__ import annotations

import os
import pickle
import resource
import secrets
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import torchfeed
from helpers import PROMPT, RangeDataset, stop_process, wait_for
from relay import C2W_SEALED, W2C_SEALED, Relay, flip_byte_at, inject_before_sealed, replay_first_sealed
from torchfeed import client
from torchfeed.protocol import auth, localpath, replies, serialize, wire

pytestmark = pytest.mark.timeout(180)

SECRET = os.environ.get("TORCHFEED_SECRET", "")  # conftest.py's; workers importing this module have none


# -- helpers -----------------------------------------------------------------------


class WorkerProcess:
    """``torchfeed worker`` in a process of its own, with optional limits on open files."""

    def __init__(self, *args: str, nofile: int = 0, env=None, log: Path | None = None):
        def limit():
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        cmd = [sys.executable, "-m", "torchfeed", "worker", "--host", "127.0.0.1", "--port", "0", *args]
        self.log = log
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=limit,
            stderr=open(log, "w") if log else None,
            env=dict(os.environ, **(env or {})),
        )
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        assert self.address, f"worker did not start (exit code {self.proc.poll()})"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def spawn():
    made = []

    def make(*args, **kw):
        made.append(WorkerProcess(*args, **kw))
        return made[-1]

    yield make
    for w in made:
        w.close()


@pytest.fixture
def relays():
    made = []

    def make(target, hook=None, **kw):
        made.append(Relay(target, hook, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def fresh_call(address: str, fn=os.getpid, args=(), timeout: float = 10.0):
    """Call ``fn`` over a new connection (not the pooled one): proves the worker accepts."""
    conn = client.Connection(address, auth.load_secret(), timeout, session=client.default_session())
    done = threading.Event()
    out = {}

    def callback(ok, value):
        out["ok"], out["value"] = ok, value
        done.set()

    try:
        meta, buffers = serialize.dumps((fn, tuple(args), {}), by_value=True)
        conn.request(wire.CALL, meta, buffers, callback=callback, timeout=timeout)
        assert done.wait(timeout), "no reply"
        if not out["ok"]:
            raise out["value"]
        return out["value"]
    finally:
        conn.close()


def served_within(address: str, seconds: float) -> float:
    """Seconds until a new client is served (retrying), or fail after ``seconds``."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < seconds:
        try:
            fresh_call(address, timeout=max(1.0, seconds - (time.monotonic() - start)))
            return time.monotonic() - start
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            last = exc
            time.sleep(0.1)
    raise AssertionError(f"no new client served within {seconds} s: {last!r}")


class Marker:
    """Unpickling this creates the file at ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def clear_frame(kind: int, meta: bytes, rid: int = 1) -> bytes:
    return wire.pack_header(kind, rid, len(meta), []) + meta


def append_line(path: str) -> int:
    with open(path, "a") as f:
        f.write("ran\n")
    return 1


class BigRange(RangeDataset):
    """Sample i: 20,000 floats equal to i (80 KB), and i."""

    def __init__(self, n: int):
        super().__init__(n, width=20_000)


def expected_batches(n: int, batch_size: int):
    ds = BigRange(n)
    return list(torch.utils.data.DataLoader(ds, batch_size=batch_size))


# -- the relay ---------------------------------------------------------------------------


def test_relay_forwards_honestly(workers2, relays):
    """Control: the relay itself works, so the failures below are the attacks' doing."""
    r = relays(workers2[0])
    assert fresh_call(r.address, lambda: 6 * 7) == 42
    assert r.connections == 1


def test_a_relay_cannot_hand_a_trainer_to_another_worker(workers2, relays):
    """Both workers hold the secret. A relay that intercepts the trainers' traffic for
    worker A (it listens on an endpoint A owns: A's port, on another loopback address) and
    hands it to worker B is refused by B, naming what was dialled and who answered. The
    same interception forwarding to A, and B dialled directly, work."""
    a, b = workers2
    to_a = relays(a)
    assert fresh_call(to_a.address, lambda: 6 * 7) == 42
    to_b = relays(b, posing_as=a)
    assert to_b.address.rsplit(":", 1)[1] == a.rsplit(":", 1)[1]
    with pytest.raises(torchfeed.AuthenticationError) as info:
        fresh_call(to_b.address)
    message = str(info.value)
    assert f"the connection to worker {to_b.address} reached a different worker" in message, message
    assert f"dialled {to_b.address}, but this is the worker at {b}" in message, message
    assert f"--reachable-at {to_b.address}" in message, message
    assert to_b.connections == 1  # it did reach B
    assert fresh_call(b, lambda: 6 * 7) == 42
    assert fresh_call("localhost:" + b.rsplit(":", 1)[1], lambda: 6 * 7) == 42  # a name for 127.0.0.1


def test_a_port_forward_is_served_only_when_the_worker_knows_that_address(spawn, relays):
    """A relay on a port of its own (an SSH tunnel, a NAT or container port mapping) is an
    endpoint the worker cannot see: refused unless the worker lists it with --reachable-at."""
    forward = relays("127.0.0.1:9", transparent=False)  # its target is set below
    plain = spawn()
    forward.target = client.parse_address(plain.address)
    with pytest.raises(torchfeed.AuthenticationError, match=f"--reachable-at {forward.address}"):
        fresh_call(forward.address)
    told = spawn("--reachable-at", forward.address)
    forward.target = client.parse_address(told.address)
    assert fresh_call(forward.address) == told.proc.pid
    anything = spawn("--reachable-at", "*")
    forward.target = client.parse_address(anything.address)
    assert fresh_call(forward.address) == anything.proc.pid


def test_every_usual_way_of_dialling_a_worker_bound_to_all_interfaces_works():
    """Bound to 0.0.0.0, a worker answers to its announced name and to every address of
    its machine (here: loopback ones), and refuses another port's trainers."""
    from torchfeed.worker.server import WorkerServer

    srv = WorkerServer(host="0.0.0.0", port=0, timeout=30).start()
    other = WorkerServer(port=0, timeout=30).start()
    relay = Relay(f"127.0.0.1:{srv.port}", posing_as=other.address)
    try:
        for address in (
            srv.address,
            f"127.0.0.1:{srv.port}",
            f"localhost:{srv.port}",
            f"127.0.0.3:{srv.port}",
        ):
            assert fresh_call(address, lambda: 6 * 7) == 42, address
        with pytest.raises(torchfeed.AuthenticationError, match=f"dialled {relay.address}, but this is"):
            fresh_call(relay.address)
    finally:
        relay.close()
        srv.stop()
        other.stop()


def test_reachable_at_entries_and_their_errors():
    from torchfeed.worker.names import Names

    def refusal(names, host, port):
        return names.refusal(auth.pack_endpoint((host, port)), ("127.0.0.1", 5000))

    names = Names("127.0.0.1", 5000, "node1:5000", ["*:7000", "127.0.0.1:7001", "[::1]:7002"])
    assert refusal(names, "127.0.0.1", 5000) is None
    assert refusal(names, "127.0.0.9", 5000) is None  # loopback reaches the same machine
    assert refusal(names, "10.1.2.3", 7000) is None
    assert refusal(names, "127.0.0.1", 7001) is None
    assert refusal(names, "::1", 7002) is None
    assert refusal(names, "10.1.2.3", 5000) == (
        "not this worker: the trainer dialled 10.1.2.3:5000, but this is the worker at node1:5000 "
        "(port 5000): a relay, port forwarding or NAT sent the connection here. If that forwarding "
        "is intended, start this worker with --reachable-at 10.1.2.3:5000"
    )
    assert "dialled 127.0.0.1:7002" in refusal(names, "127.0.0.1", 7002)
    assert "dialled [::1]:5001" in refusal(names, "::1", 5001)
    why = names.refusal(bytes(auth.ENDPOINT_BYTES), ("127.0.0.1", 5000))
    assert why is not None and "dialled an unknown address" in why
    assert refusal(Names("127.0.0.1", 5000, "x", ["*"]), "10.1.2.3", 1) is None
    for bad in ("node1", "node1:", ":7000", "node1:70000", "node1:x"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            Names("127.0.0.1", 5000, "x", [bad])


def test_injected_call_is_never_executed(workers2, relays, tmp_path):
    marker = tmp_path / "injected-call-ran"
    evil = clear_frame(wire.CALL, pickle.dumps((Marker(str(marker)), (), {})))
    r = relays(workers2[0], inject_before_sealed(evil, "c2w"))
    with pytest.raises((torchfeed.WorkerLost, ConnectionError)):
        fresh_call(r.address)
    time.sleep(0.5)
    assert not marker.exists()
    assert fresh_call(workers2[0]) > 0  # the worker goes on serving


def test_forged_reply_is_never_delivered(workers2, relays, tmp_path):
    marker = tmp_path / "forged-reply-unpickled"
    forged = clear_frame(wire.REPLY, pickle.dumps(Marker(str(marker))))
    r = relays(workers2[0], inject_before_sealed(forged, "w2c"))
    with pytest.raises((torchfeed.WorkerLost, torchfeed.ProtocolError)):
        fresh_call(r.address)
    assert not marker.exists()


def test_replayed_request_runs_once(workers2, relays, tmp_path):
    log = tmp_path / "calls"
    r = relays(workers2[0], replay_first_sealed("c2w"))
    try:
        fresh_call(r.address, append_line, (str(log),))
    except (torchfeed.WorkerLost, ConnectionError):
        pass  # the worker may hang up before the reply: the copy broke the record order
    # the copy closes the connection: the call ran once, or not at all when the worker
    # dropped it with its closed connection before an executor took it; never twice
    time.sleep(1.0)
    assert not log.exists() or log.read_text() == "ran\n"


def test_flipped_bit_in_a_reply_is_detected(workers2, relays):
    payload = torch.arange(100_000, dtype=torch.float32)
    r = relays(workers2[0], flip_byte_at(W2C_SEALED + 200_000, "w2c"))
    with pytest.raises((torchfeed.WorkerLost, torchfeed.ProtocolError)) as info:
        fresh_call(r.address, lambda: payload * 1)
    assert "authentication" in str(info.value) or "lost" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["tamper-reply", "replay-request", "inject-call", "inject-reply"])
def test_loader_finishes_the_epoch_exactly_once_under_attack(fresh_workers, relays, attack, tmp_path):
    """One of two workers is reached through the attacker: the epoch still yields every
    sample exactly once, with exact values, through the other worker or a reconnect."""
    w = fresh_workers(2)
    marker = tmp_path / "unpickled"
    hooks = {
        "tamper-reply": flip_byte_at(W2C_SEALED + 150_000, "w2c", conn=0),
        # after the calls that build the dataset (a failure there fails RemoteDataset at once)
        "replay-request": replay_first_sealed("c2w", conn=0, after=2),
        "inject-call": inject_before_sealed(
            clear_frame(wire.CALL, pickle.dumps((Marker(str(marker)), (), {}))), "c2w", conn=0, after=2
        ),
        "inject-reply": inject_before_sealed(
            clear_frame(wire.REPLY, pickle.dumps(Marker(str(marker)))), "w2c", conn=0, after=2
        ),
    }
    r = relays(w.addresses[1], hooks[attack])
    n, bs = 48, 4
    ds = torchfeed.RemoteDataset([w.addresses[0], r.address], BigRange, n)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the loss of the attacked connection is reported
            got = list(torchfeed.RemoteDataLoader(ds, batch_size=bs, timeout=60))
    finally:
        ds.close()
    want = expected_batches(n, bs)
    assert len(got) == len(want)
    for (x, y), (ex, ey) in zip(got, want):
        assert torch.equal(y, ey) and torch.equal(x, ex)
    assert not marker.exists()


# -- what a capture of the wire shows ---------------------------------------------------------

KEY_MARKER = "AKIA-object-store-key-MUST-NOT-LEAK-0123456789"
BATCH_MARKER = b"BATCH-BYTES-IN-CLEAR?"


class MarkedDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, storage_options: dict):
        self.n = n
        self.options = storage_options

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.frombuffer(bytearray(BATCH_MARKER * 50), dtype=torch.uint8)


def capture_run(address: str, relays) -> bytes:
    r = relays(address)
    ds = torchfeed.RemoteDataset([r.address], MarkedDataset, 8, storage_options={"key": KEY_MARKER})
    try:
        batches = list(torchfeed.RemoteDataLoader(ds, batch_size=4))
    finally:
        ds.close()
    assert len(batches) == 2 and bytes(batches[0][0].numpy()) == BATCH_MARKER * 50
    return r.captured()


@pytest.mark.slow
def test_capture_holds_no_dataset_argument_and_no_batch_bytes(spawn, relays):
    w = spawn()
    wire_bytes = capture_run(w.address, relays)
    assert len(wire_bytes) > 1000
    assert KEY_MARKER.encode() not in wire_bytes
    assert BATCH_MARKER not in wire_bytes
    assert b"MarkedDataset" not in wire_bytes


@pytest.mark.slow
def test_integrity_only_opt_out_is_readable_but_still_authenticated(spawn, relays, monkeypatch):
    """Control for the capture test (the markers are visible when encryption is off), and
    the opt-out keeps integrity: a flipped bit is still caught."""
    monkeypatch.setenv(auth.ENV_NO_ENCRYPTION, "1")
    w = spawn("--trusted-network-no-encryption")
    wire_bytes = capture_run(w.address, relays)
    assert KEY_MARKER.encode() in wire_bytes and BATCH_MARKER in wire_bytes
    r = relays(w.address, flip_byte_at(W2C_SEALED + 100, "w2c"))
    with pytest.raises((torchfeed.WorkerLost, torchfeed.ProtocolError)):
        fresh_call(r.address, lambda: bytes(5000))


def test_opt_out_needs_both_sides(spawn, relays, monkeypatch):
    """A client that opts out still gets encryption from a worker that did not."""
    monkeypatch.setenv(auth.ENV_NO_ENCRYPTION, "1")
    w = spawn(env={auth.ENV_NO_ENCRYPTION: ""})
    wire_bytes = capture_run(w.address, relays)
    assert KEY_MARKER.encode() not in wire_bytes and BATCH_MARKER not in wire_bytes


@pytest.mark.skipif(
    not os.path.exists("/usr/bin/tcpdump") and not os.path.exists("/usr/sbin/tcpdump"),
    reason="tcpdump is not installed",
)
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="capturing on loopback needs root")
def test_tcpdump_of_loopback_holds_nothing_in_clear(spawn, tmp_path, tcp_only):
    w = spawn()
    port = w.address.rsplit(":", 1)[1]
    pcap, err = tmp_path / "lo.pcap", tmp_path / "tcpdump.err"
    dump = subprocess.Popen(
        [
            "tcpdump",
            "-i",
            "lo",
            "--immediate-mode",
            "-Z",
            "root",
            "-U",
            "-s",
            "0",
            "-w",
            str(pcap),
            "tcp",
            "port",
            port,
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(err, "w"),
    )
    try:
        assert wait_for(lambda: "listening on" in err.read_text(), timeout=10)
        time.sleep(1.0)  # the filter is attached just after tcpdump says it listens
        ds = torchfeed.RemoteDataset([w.address], MarkedDataset, 8, storage_options={"key": KEY_MARKER})
        batches = list(torchfeed.RemoteDataLoader(ds, batch_size=4))
        ds.close()
        assert len(batches) == 2
        time.sleep(0.5)
    finally:
        dump.terminate()
        dump.wait(10)
    data = pcap.read_bytes()
    assert len(data) > 2000, err.read_text()
    assert KEY_MARKER.encode() not in data and BATCH_MARKER not in data


# -- floods ------------------------------------------------------------------------------------


def _connect_many(address: str, n: int, first_bytes: bytes = b"") -> list:
    host, port = address.rsplit(":", 1)
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
        except OSError:
            continue
        if first_bytes:
            try:
                s.sendall(first_bytes)
            except OSError:
                pass
        socks.append(s)
    return socks


@pytest.fixture
def many_fds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip("this test process needs 2048 open files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
def test_idle_and_half_open_floods_under_a_low_fd_limit(spawn, many_fds, tmp_path):
    # handshakes held open far longer than a client waits: only the cap lets one in
    w = spawn("--handshake-timeout", "600", nofile=512, log=tmp_path / "worker.log")
    held = _connect_many(w.address, 300)
    during = served_within(w.address, PROMPT)  # the cap lets a real client in during the flood
    held += _connect_many(w.address, 300)
    assert w.alive()
    after_idle = served_within(w.address, PROMPT)
    # half-open handshakes: a valid AUTH header, then nothing
    partial = wire.pack_header(wire.AUTH, 0, auth.AUTH_BYTES, []) + b"\x00" * 10
    held += _connect_many(w.address, 300, partial)
    assert w.alive()
    after_half_open = served_within(w.address, PROMPT)
    for s in held:
        s.close()
    assert w.alive()
    served_within(w.address, PROMPT)
    print(
        f"served during the flood after {during:.2f} s, after 600 idle {after_idle:.2f} s, "
        f"after 300 half-open {after_half_open:.2f} s"
    )


@pytest.mark.slow
def test_a_flood_from_one_source_sheds_its_own_connections(spawn, tmp_path):
    """One source (127.0.0.2) holds 300 idle connections and replaces every one the worker
    drops; meanwhile a trainer on 127.0.0.1 connects 30 times. Every handshake succeeds (at
    capacity the worker evicts the flooding source's handshakes, never the trainer's) and
    none waits for the flood to end. Before, the oldest handshake of any source was evicted:
    with 32 slots most of the trainer's handshakes were reset."""
    log = tmp_path / "worker.log"
    w = spawn("--max-handshakes", "32", "--log-level", "INFO", log=log)
    host, port = w.address.rsplit(":", 1)
    flooder = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve().parent / "flooder.py"), host, port, "300", "60"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    times, failures = [], []
    try:
        assert flooder.stdout is not None
        assert flooder.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        for _ in range(30):
            start = time.monotonic()
            try:
                client.Connection(w.address, auth.load_secret(), 10, session=client.default_session()).close()
                times.append(time.monotonic() - start)
            except (OSError, torchfeed.TorchfeedError) as exc:
                failures.append(repr(exc))
        flooding = flooder.poll() is None
    finally:
        report = flooder.communicate(timeout=20)[0].strip()  # closes its stdin: it stops and reports
    times.sort()
    print(
        f"{report}; trainer: {len(times)} handshakes, median {times[len(times) // 2] * 1000 if times else 0:.1f} ms"
    )
    assert flooding, report
    # each handshake within its 10 s timeout: not queued behind the flood (it lasts 60 s)
    assert not failures, (failures, report)
    assert "dropping the oldest of 127.0.0.2's" in log.read_text()
    assert w.alive()


@pytest.mark.slow
def test_accept_survives_running_out_of_file_descriptors(spawn, many_fds, tmp_path, monkeypatch):
    """With more handshakes allowed than descriptors, accept() hits EMFILE: the worker
    logs it, sheds the oldest handshake, backs off and keeps serving, over TCP and over the
    same-host socket (which the flood cannot starve: it is accepted from first)."""
    log = tmp_path / "worker.log"
    w = spawn("--handshake-timeout", "600", "--max-handshakes", "100000", nofile=96, log=log)
    held = _connect_many(w.address, 400)
    assert wait_for(lambda: "cannot accept connections" in log.read_text(), timeout=15)
    assert w.alive()
    served_within(w.address, PROMPT)  # same-host
    monkeypatch.setenv(localpath.ENV, "tcp")
    served_within(w.address, PROMPT)  # TCP, in the flood's own queue
    monkeypatch.delenv(localpath.ENV)
    for s in held:
        s.close()
    assert w.alive()
    served_within(w.address, PROMPT)


def test_wrong_secrets_are_rate_limited_per_source(spawn, tmp_path):
    """A burst of wrong secrets: after ten, no more answers and no more log lines for that
    source; a right secret from the same source still gets in at once (no lockout)."""
    log = tmp_path / "worker.log"
    w = spawn("--log-level", "INFO", log=log)
    wrong = secrets.token_hex(32)
    answered = silent = 0
    for i in range(40):
        try:
            client.Connection(w.address, auth.load_secret(wrong), 5, session=client.default_session()).close()
        except torchfeed.AuthenticationError:
            answered += 1
        except (torchfeed.ProtocolError, OSError, torchfeed.WorkerLost):
            silent += 1  # closed without AUTH_FAIL: this source is out of tokens
        if i == 30:
            assert fresh_call(w.address) == w.proc.pid  # mid-attack, the right secret gets in
    assert answered <= 15 and silent >= 20, (answered, silent)
    lines = [line for line in log.read_text().splitlines() if "rejected client" in line]
    assert 1 <= len(lines) <= 3, lines
    assert fresh_call(w.address) == w.proc.pid


class _ThreadsRunOut:
    """Stands in for the threading module in worker/serverconn.py: the first ``n`` connection threads
    cannot be started, as when the process has hit its thread limit."""

    def __init__(self, n: int, prefix: str):
        self.left, self.prefix = n, prefix
        outer = self

        class Thread(threading.Thread):
            def start(self):
                if self.name.startswith(outer.prefix) and outer.left > 0:
                    outer.left -= 1
                    raise RuntimeError("can't start new thread")
                super().start()

        self.Thread = Thread

    def __getattr__(self, name):
        return getattr(threading, name)


@pytest.mark.parametrize("which", ["torchfeed-tx", "torchfeed-rx"], ids=["writer", "reader"])
def test_a_worker_that_cannot_start_threads_keeps_accepting(monkeypatch, which):
    """A connection whose threads cannot start is closed and forgotten; the worker goes on."""
    from torchfeed.worker import server as worker_mod
    from torchfeed.worker import serverconn

    server = worker_mod.WorkerServer().start()
    monkeypatch.setattr(serverconn, "threading", _ThreadsRunOut(3, which))
    try:
        address = f"127.0.0.1:{server.port}"
        for _ in range(3):
            with pytest.raises((torchfeed.WorkerLost, ConnectionError, torchfeed.ProtocolError, OSError)):
                fresh_call(address, timeout=5)
        assert wait_for(lambda: not server.connections(), timeout=5), "a failed connection was kept"
        assert fresh_call(address) == os.getpid()
    finally:
        server.stop()


@pytest.mark.slow
def test_slow_upload_longer_than_the_timeout_is_not_cut(spawn, relays):
    """The worker's keeper judges liveness by records arriving, not by whole calls."""
    w = spawn("--timeout", "2")

    def slow(index, direction, offset, data):
        if direction == "c2w" and offset > C2W_SEALED:
            time.sleep(0.03)  # ~2 MB/s: an 8 MB call takes ~4 s, twice the worker's timeout
        return data

    r = relays(w.address, slow)
    payload = b"u" * (8 << 20)
    assert fresh_call(r.address, len, (payload,), timeout=60) == len(payload)


def test_closing_while_a_reply_is_received_fails_that_request(spawn, tcp_only):
    w = spawn()
    conn = client.Connection(w.address, auth.load_secret(), 10, session=client.default_session())
    done = threading.Event()
    out = []

    def callback(ok, value):
        out.append((ok, value))
        done.set()

    meta, buffers = serialize.dumps((big_reply, (300 << 20,), {}), by_value=True)
    conn.request(wire.CALL, meta, buffers, callback=callback)
    assert wait_for(lambda: conn.channel.bytes_received > (20 << 20), timeout=30)
    conn.close()
    assert done.wait(10), "the request being received was never answered"
    assert len(out) == 1 and out[0][0] is False


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str")

    def __repr__(self):
        raise RuntimeError("no repr")


def raise_unprintable():
    raise _Unprintable()


def test_an_exception_that_cannot_be_printed_still_gets_an_answer(workers2):
    with pytest.raises(torchfeed.TorchfeedError, match="Unprintable"):
        torchfeed.rpc_async(workers2[0], raise_unprintable, timeout=20).wait()
    assert torchfeed.rpc_async(workers2[0], os.getpid, timeout=20).wait() > 0


# -- a client that stops reading, and per-connection bounds ----------------------------------


def big_reply(nbytes: int):
    return torch.empty(nbytes, dtype=torch.uint8)


@pytest.mark.slow
def test_a_client_that_stops_reading_does_not_stall_others(spawn):
    w = spawn("--parallel", "1")
    host, port = w.address.rsplit(":", 1)
    stalled = socket.create_connection((host, int(port)))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    chan = auth.client_handshake(stalled, auth.load_secret(), w.address)
    meta, buffers = serialize.dumps((big_reply, (256 << 20,), {}), by_value=True)
    chan.send(wire.CALL, 1, meta, buffers)  # ... and never read the 256 MB reply
    try:
        time.sleep(1.0)  # the executor has produced the reply, the writer is stuck on it
        # were they queued behind the stuck writer, these calls would time out (it never ends)
        for _ in range(5):
            assert fresh_call(w.address, timeout=PROMPT) > 0
        assert w.alive()
    finally:
        stalled.close()


def numbered_reply(i: int, nbytes: int):
    return torch.full((nbytes,), i % 251, dtype=torch.uint8)


def test_small_replies_to_a_paused_reader_arrive_whole(spawn):
    """Small replies are written by the executor without blocking; what the socket does
    not take goes to the writer. A client that pauses reading fills the socket, so many
    replies are cut mid-record: after it reads again, every reply is intact and in order."""
    w = spawn("--parallel", "2")
    host, port = w.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    # a small receive buffer (not tiny: a window far below the MSS makes loopback TCP crawl)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 18)
    chan = auth.client_handshake(sock, auth.load_secret(), w.address)
    count, size = 1000, 20_000  # 20 MB of replies, far more than the socket buffers hold
    try:
        for i in range(count):
            meta, buffers = serialize.dumps((numbered_reply, (i, size), {}), by_value=True)
            chan.send(wire.CALL, i + 1, meta, buffers)
        time.sleep(1.0)  # replies pile up: direct writes are cut, the rest is queued
        assert fresh_call(w.address, timeout=10) > 0  # other clients are served meanwhile
        sock.settimeout(30)
        seen = set()
        for _ in range(count):  # two executors race for the socket: any order, each whole
            frame = chan.read_frame(wire.Limits())
            assert frame.kind == wire.REPLY, wire.KIND_NAMES.get(frame.kind)
            bufs = [memoryview(bytearray(n)) for n in frame.buffer_lengths]
            chan.read_buffers(bufs)
            value = replies.SAFE.loads(frame.meta, bufs)
            i = frame.request_id - 1
            assert value.shape == (size,) and bool((value == i % 251).all())
            seen.add(i)
        assert seen == set(range(count))
        assert w.alive()
    finally:
        sock.close()


@pytest.mark.slow
def test_per_connection_bounds_answer_with_clear_errors(spawn):
    w = spawn(
        "--parallel", "1", "--max-call-bytes", "1000000", "--max-refs", "3", "--max-queued-requests", "4"
    )
    # call size
    with pytest.raises(torchfeed.TorchfeedError, match="--max-call-bytes"):
        torchfeed.rpc_async(w.address, len, args=(b"x" * 2_000_000,), timeout=20).wait()
    assert (
        torchfeed.rpc_async(w.address, len, args=(b"x" * 1000,), timeout=20).wait() == 1000
    )  # same connection
    # remote references
    refs = [torchfeed.rpc_async(w.address, dict, rref=True, timeout=20).wait() for _ in range(3)]
    with pytest.raises(torchfeed.TorchfeedError, match="--max-refs"):
        torchfeed.rpc_async(w.address, dict, rref=True, timeout=20).wait()
    refs.pop().release()
    assert wait_for(lambda: _try_ref(w.address), timeout=10)
    # queued requests
    futs = [torchfeed.rpc_async(w.address, time.sleep, args=(0.2,), timeout=30) for _ in range(10)]
    outcomes = []
    for f in futs:
        try:
            f.wait()
            outcomes.append("ok")
        except torchfeed.TorchfeedError as exc:
            assert "--max-queued-requests" in str(exc)
            outcomes.append("refused")
    assert outcomes.count("refused") >= 1 and outcomes.count("ok") >= 4
    assert torchfeed.rpc_async(w.address, os.getpid, timeout=20).wait() == w.proc.pid


def _try_ref(address: str) -> bool:
    try:
        torchfeed.rpc_async(address, dict, rref=True, timeout=20).wait()
        return True
    except torchfeed.TorchfeedError:
        return False


# -- address files ------------------------------------------------------------------------------


def test_address_file_others_can_write_is_refused(tmp_path):
    from torchfeed.protocol.addrfile import UnsafeAddressFile, announce, read_address_file

    path = tmp_path / "workers"
    announce("127.0.0.1:1234", str(path))
    assert (path.stat().st_mode & 0o777) == 0o600
    assert read_address_file(str(path)) == ["127.0.0.1:1234"]
    os.chmod(path, 0o620)
    with pytest.raises(UnsafeAddressFile, match="chmod 600"):
        read_address_file(str(path))
    with pytest.raises(UnsafeAddressFile):
        torchfeed.RemoteDataset.from_file(str(path), RangeDataset, 4, wait_timeout=1)
