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
import time

import numpy as np
import pytest

import torchfeed
from helpers import PROMPT, FakeWorker
from torchfeed import LocalWorkers
from torchfeed.errors import AuthenticationError, TorchfeedError
from torchfeed.protocol import auth, localpath, serialize, shm, wire

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
    assert placed is not None
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


class HostileNeighbour(FakeWorker):
    """A same-uid "worker" on this machine (see the module docstring)."""

    def __init__(self, answer):
        self.answer = answer
        self.tcp = socket.create_server(("127.0.0.1", 0))
        port = self.tcp.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(localpath.name_of("127.0.0.1", port))
        unix.listen()
        super().__init__(unix, same_host=True)

    def serve(self, sock, keys, received: bytes) -> None:
        assert keys.local
        reader = wire.FrameReader(sock, received[wire.HEADER.size + auth.AUTH_BYTES :])
        call = reader.read_frame(wire.Limits())
        reader.skip_buffers(call.buffer_lengths)
        message, fds = self.answer(call.request_id)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sock.sendmsg([message], rights)
        for fd in fds:
            os.close(fd)

    def close(self) -> None:
        self.tcp.close()
        super().close()


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
    # every descriptor it sent was closed (the connection's reader may still be on its way out)
    deadline = time.monotonic() + 30
    while own_fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert own_fds() <= before


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


# -- the channel pair, without processes: what the worker's side does under pressure -----------------


def channel_pair(budget: int = shm.DEFAULT_BUDGET):
    from torchfeed.protocol.localchannel import FdReader, LocalChannel

    w, t = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    said: list[str] = []
    worker = LocalChannel(w, reader=FdReader(w), arena=shm.Arena(budget, said.append))
    trainer = LocalChannel(t, reader=FdReader(t), mappings=shm.Mappings())
    return worker, trainer, said


def receive(trainer) -> tuple[wire.Frame, list]:
    frame = trainer.read_header(wire.Limits())
    trainer.read_meta(frame)
    return frame, trainer.receive_buffers(frame, False, "worker")


def test_an_array_the_worker_keeps_is_sent_as_a_snapshot():
    """Only the batch a call just collated travels as it lies in its slot: an array the
    worker keeps (allocated in an earlier call) is copied, so neither side's later writes
    reach the other."""
    from torchfeed.protocol import buffers

    worker, trainer, _ = channel_pair()
    with buffers.lending(worker.arena):  # an earlier call made it and something kept it
        kept = buffers.empty_array(4 << 20)
    kept[:] = 1
    with buffers.lending(worker.arena) as fresh:  # this call returns it
        pass
    worker.send(wire.REPLY, 1, b"m", [kept], placed=worker.arena.place([kept.data], fresh))
    _, (got,) = receive(trainer)
    arr = np.frombuffer(got, dtype=np.uint8)
    kept[:] = 7
    assert arr[:3].tolist() == [1, 1, 1]
    arr[:] = 9
    assert kept[:3].tolist() == [7, 7, 7]
    with buffers.lending(worker.arena) as fresh:  # a batch collated by the call itself: no copy
        batch = buffers.empty_array(4 << 20)
    batch[:] = 5
    worker.send(wire.REPLY, 2, b"m", [batch], placed=worker.arena.place([batch.data], fresh))
    _, (got,) = receive(trainer)
    assert (
        np.frombuffer(got, dtype=np.uint8).__array_interface__["data"][0]
        != batch.__array_interface__["data"][0]
    )
    assert np.frombuffer(got, dtype=np.uint8)[:2].tolist() == [5, 5]


def test_a_slot_the_system_refuses_sends_the_batch_through_the_socket():
    """Out of descriptors (or memory, or mappings), the arena gives no slot: the collate
    allocates ordinary memory and the reply travels in the message, with one warning."""
    import resource

    from torchfeed.protocol import buffers

    worker, trainer, said = channel_pair()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hogs: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (own_fds() + 8, hard))
    try:
        try:
            while True:
                hogs.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        with buffers.lending(worker.arena) as fresh:
            batch = buffers.empty_array(4 << 20)
        batch[:] = 3
        placed = worker.arena.place([batch.data], fresh)
        assert placed.where == [(0, 0)] and said
        for fd in hogs[:4]:  # room for the reader to receive (no descriptor travels)
            os.close(fd)
        got: dict = {}
        reader = threading.Thread(target=lambda: got.update(reply=receive(trainer)))
        reader.start()  # 4 MiB through the socket: the trainer reads while the worker writes
        worker.send(wire.REPLY, 1, b"m", [batch], placed=placed)
        reader.join(60)
        frame, (data,) = got["reply"]
        assert frame.where == [(0, 0)] and np.frombuffer(data, dtype=np.uint8)[:2].tolist() == [3, 3]
    finally:
        for fd in hogs[4:]:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_new_slots_wait_for_a_busy_trainer_as_long_as_any_send():
    """A reply that brings new slots is sent even though the trainer reads nothing for
    longer than the socket's send timeout (1 s): it waits for the stall timeout, as any
    send does."""
    worker, trainer, _ = channel_pair()
    worker.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 1, 0))
    worker.send_stall_timeout = 60.0
    worker.sock.setblocking(False)
    try:
        while True:  # a trainer busy elsewhere: the socket's buffer fills
            worker.sock.send(b"x" * 4096)
    except BlockingIOError:
        pass
    worker.sock.setblocking(True)
    worker.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 1, 0))
    drained = threading.Event()

    def read_later():
        time.sleep(2.5)  # longer than the send timeout
        while trainer.sock.recv(1 << 20):
            if drained.is_set():
                return

    threading.Thread(target=read_later, daemon=True).start()
    worker.send(
        wire.REPLY, 1, b"m", [np.ones(1 << 20, dtype=np.uint8)]
    )  # a new slot: its descriptor goes along
    drained.set()


def test_a_trainer_that_set_small_reply_limits_maps_what_the_worker_may_hold():
    """Reply limits bound one reply; the worker's budget bounds the slots the trainer maps."""
    worker, trainer, _ = channel_pair()
    held = []
    for rid in range(6):  # six 3 MiB batches held at once
        worker.send(wire.REPLY, rid, b"m", [np.full(3 << 20, rid, dtype=np.uint8)])
        frame = trainer.read_header(wire.Limits(max_buffer_bytes=8 << 20))
        trainer.read_meta(frame)
        held.append(trainer.receive_buffers(frame, False, "worker"))
    assert [np.frombuffer(b[0], dtype=np.uint8)[0] for b in held] == list(range(6))


def test_an_address_is_local_only_if_the_kernel_routes_it_to_itself():
    """With ip_nonlocal_bind any address can be bound: a remote worker's address must not
    count as this machine's (the same-host socket of a local worker would stand in for it).
    Checked in a private network namespace."""
    script = (
        "import sys; sys.path.insert(0, {!r})\n"
        "from torchfeed.protocol.localpath import is_local\n"
        "import socket, subprocess\n"
        "subprocess.run(['ip', 'link', 'set', 'lo', 'up'], check=True)\n"
        "open('/proc/sys/net/ipv4/ip_nonlocal_bind', 'w').write('1')\n"
        "s = socket.socket(); s.bind(('203.0.113.7', 0)); s.close()\n"
        "print(is_local('203.0.113.7'), is_local('127.0.0.1'), is_local('127.0.0.9'))\n"
    ).format(os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))
    import subprocess
    import sys

    run = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    if run.returncode != 0 and ("unshare" in run.stderr or "Operation not permitted" in run.stderr):
        pytest.skip(f"no private network namespace here: {run.stderr.strip()[-200:]}")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True", "True"]


def test_a_process_exiting_while_a_thread_fills_a_slot_exits_cleanly():
    """Slots stay mapped through interpreter exit: a daemon thread still stacking a batch
    into one (an executor when the worker is told to stop) must not fault."""
    import subprocess
    import sys

    script = (
        "import sys, threading, time; sys.path.insert(0, {!r})\n"
        "from torchfeed.protocol import shm\n"
        "batch = shm.Arena().lease(64 << 20)\n"
        "def fill():\n"
        "    while True:\n"
        "        batch[:] = 1\n"
        "threading.Thread(target=fill, daemon=True).start()\n"
        "time.sleep(0.3)\n"
    ).format(os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
