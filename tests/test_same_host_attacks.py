"""A hostile peer on the same-host path gets a closed connection, never a crash or a leak.

The "worker" here listens where a real one would (TCP and the same-host name beside it),
completes the real handshake (the doorman's ``judge``) and answers the trainer's call with
shared memory it crafted: descriptors that are not sealed memory files, slots smaller than
announced, placements outside a slot, slots never announced, too few descriptors. Then the
other direction: a client that sends descriptors to a real worker, and a TCP client that
asks for the unsealed same-host mode.
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import struct
import threading

import numpy as np
import pytest

import torchfeed
from helpers import PROMPT
from torchfeed import LocalWorkers
from torchfeed.errors import AuthenticationError, TorchfeedError
from torchfeed.protocol import auth, localpath, serialize, shm, wire
from torchfeed.worker.doorman import judge

pytestmark = pytest.mark.timeout(120)

VALUE = np.arange(1 << 18, dtype=np.uint8)  # 256 KiB: placed in shared memory


def own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def memfd(size: int, seal: bool = True) -> int:
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def reply(rid: int, *, fds: list[int], new, where, dropped=()) -> tuple[bytes, list[int]]:
    meta, out = serialize.dumps_reply(VALUE)
    lengths = [memoryview(b).nbytes for b in out]
    table = shm.Placed([(i, cap, -1) for i, cap in new], list(dropped), where).table()
    head = wire.pack_fixed(wire.REPLY, rid, len(meta), len(lengths), wire.FLAG_SHM)
    message = head + struct.pack(f"<{len(lengths)}Q", *lengths) + table + meta
    return message, fds


def honest(rid):
    meta, out = serialize.dumps_reply(VALUE)
    arena = shm.Arena()
    placed = arena.place([memoryview(b).cast("B") for b in out])
    HOLD.append(arena)
    lengths = [memoryview(b).nbytes for b in out]
    head = wire.pack_fixed(wire.REPLY, rid, len(meta), len(lengths), wire.FLAG_SHM)
    return head + struct.pack(f"<{len(lengths)}Q", *lengths) + placed.table() + meta, [
        os.dup(fd) for fd in placed.fds
    ]


HOLD: list = []
CAP = 1 << 20


def pipe_instead(rid):
    r, w = os.pipe()
    os.close(w)
    return reply(rid, fds=[r], new=[(1, CAP)], where=[(1, 0)])


def unsealed(rid):
    return reply(rid, fds=[memfd(shm.HEAD + CAP, seal=False)], new=[(1, CAP)], where=[(1, 0)])


def smaller_than_announced(rid):
    return reply(rid, fds=[memfd(shm.HEAD + 4096)], new=[(1, CAP)], where=[(1, 0)])


def placed_outside(rid):
    return reply(rid, fds=[memfd(shm.HEAD + CAP)], new=[(1, CAP)], where=[(1, CAP - 100)])


def never_announced(rid):
    return reply(rid, fds=[], new=[], where=[(7, 0)])


def too_few_descriptors(rid):
    return reply(rid, fds=[memfd(shm.HEAD + CAP)], new=[(1, CAP), (2, CAP), (3, CAP)], where=[(1, 0)])


class HostileNeighbour:
    """A same-uid "worker" on this machine (see the module docstring)."""

    def __init__(self, answer):
        self.answer = answer
        self.tcp = socket.create_server(("127.0.0.1", 0))
        port = self.tcp.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(localpath.name_of("127.0.0.1", port))
        self.unix.listen()
        self.answered = threading.Event()
        self.failure: BaseException | None = None
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            sock, _ = self.unix.accept()
            self._socks.append(sock)
            leftover = self._handshake(sock)
            reader = wire.FrameReader(sock, leftover)
            call = reader.read_frame(wire.Limits())
            reader.skip_buffers(call.buffer_lengths)
            message, fds = self.answer(call.request_id)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            sock.sendmsg([message], rights)
            for fd in fds:
                os.close(fd)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc
        finally:
            self.answered.set()

    @staticmethod
    def _handshake(sock: socket.socket) -> bytes:
        hello = auth.hello_meta(False)
        wire.send_frame(sock, wire.HELLO, meta=hello)
        received = b""
        while True:
            verdict, reply_meta, keys = judge(received, hello, auth.load_secret(), same_host=True)
            if verdict != "more":
                break
            data = sock.recv(4096)
            assert data, "the trainer closed during the handshake"
            received += data
        assert verdict == "ok" and keys is not None and keys.local, (verdict, reply_meta)
        wire.send_frame(sock, wire.AUTH_OK, meta=reply_meta)
        return received[wire.HEADER.size + auth.AUTH_BYTES :]

    def close(self) -> None:
        self.tcp.close()
        self.unix.close()
        for sock in self._socks:
            sock.close()


def test_the_hostile_neighbour_speaks_the_protocol():
    """The harness itself: an honest shared-memory reply from it is read as the value."""
    neighbour = HostileNeighbour(honest)
    try:
        with torchfeed.Session(compression=None) as session:
            got = session.rpc_async(neighbour.address, os.getpid, timeout=30).wait()
            assert neighbour.answered.wait(PROMPT) and neighbour.failure is None, neighbour.failure
            assert np.array_equal(got, VALUE)
            assert session.connections()[0].channel.local
    finally:
        neighbour.close()
        for arena in HOLD:
            arena.close()
        HOLD.clear()


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (pipe_instead, "not a sealed memory file"),
        (unsealed, "not a sealed memory file"),
        (smaller_than_announced, "not a sealed memory file"),
        (placed_outside, "outside its slot"),
        (never_announced, "never announced"),
        (too_few_descriptors, "brought 1 descriptors"),
    ],
    ids=["pipe", "unsealed", "smaller", "outside", "unannounced", "too-few-fds"],
)
def test_crafted_shared_memory_fails_the_connection_and_leaks_nothing(answer, why):
    before = own_fds()
    neighbour = HostileNeighbour(answer)
    try:
        with torchfeed.Session(compression=None) as session:
            future = session.rpc_async(neighbour.address, os.getpid, timeout=30)
            with pytest.raises(TorchfeedError) as info:
                future.wait()
            assert neighbour.failure is None, neighbour.failure
            text = f"{info.value} {info.value.__cause__}"
            assert why in text, text
    finally:
        neighbour.close()
    assert own_fds() <= before  # every descriptor it sent was closed


def test_a_worker_drops_a_client_that_sends_descriptors_and_serves_on():
    with LocalWorkers(1) as workers:
        address = workers.addresses[0]
        port = int(address.rsplit(":", 1)[1])
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(localpath.name_of("127.0.0.1", port))
        keys, reader = auth.client_session(sock, auth.load_secret(), address, same_host=("127.0.0.1", port))
        assert keys.local
        fd = memfd(4096)
        call = wire.pack_fixed(wire.PING, 1, 0, 0)
        sock.sendmsg([call], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        os.close(fd)
        sock.settimeout(PROMPT)
        assert sock.recv(100) == b""  # dropped, no PONG
        sock.close()
        with torchfeed.Session() as session:
            assert session.rpc_async(address, os.getpid, timeout=30).wait() == workers.processes[0].pid


def test_the_unsealed_mode_is_refused_over_tcp():
    """A client holding the secret that asks for the same-host mode over TCP is refused:
    unsealed sessions exist only on the socket whose peer the kernel vouched for."""
    with LocalWorkers(1) as workers:
        host, port = workers.addresses[0].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        with pytest.raises(AuthenticationError, match="only for the worker's same-host socket"):
            auth.client_session(sock, auth.load_secret(), workers.addresses[0], same_host=(host, int(port)))
        sock.close()
