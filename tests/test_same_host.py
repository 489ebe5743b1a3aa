"""The same-host path: who gets it, what it leaves behind, and what it costs nobody.

Workers here are real processes (LocalWorkers, ``torchfeed worker``); another user is a real
second uid (the ``other_user`` fixture); the small ``/dev/shm`` is a real tmpfs in a private
mount namespace.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import torchfeed
from helpers import wait_for
from relay import Relay
from torchfeed import LocalWorkers, RemoteDataLoader, RemoteDataset
from torchfeed.client.session import Session
from torchfeed.protocol import localpath, shm

BIG = (3, 224, 224)  # one sample: 602 KB of float32; 64 of them: 38.5 MB


class Filled(torch.utils.data.Dataset):
    """Sample i is a float32 image filled with i: a batch shows which samples it holds."""

    def __init__(self, n: int, shape=BIG):
        self.n, self.shape = n, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full(self.shape, float(i)), i


def slot_maps(pid: int | str = "self", worker: int | None = None) -> list[int]:
    """Sizes of the shared slots mapped in process ``pid`` (only ``worker``'s, if given)."""
    sizes = []
    mark = "memfd:torchfeed-slot-" + ("" if worker is None else f"{worker}-")
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if mark in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                sizes.append(hi - lo)
    return sizes


def slot_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += "memfd:torchfeed-slot" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return n


def one_epoch(loader) -> tuple[list[int], bool]:
    seen, intact = [], True
    for x, y in loader:
        intact &= bool((x.flatten(1)[:, 0] == y.float()).all() and (x.flatten(1)[:, -1] == y.float()).all())
        seen += y.tolist()
    return seen, intact


def test_the_path_follows_the_host_and_the_option(monkeypatch):
    """A worker of this machine and uid: same-host socket. The same worker dialled through a
    relay (what a remote worker looks like), or with TORCHFEED_SAME_HOST=tcp: TCP."""
    with LocalWorkers(1) as workers, Session() as near:
        address = workers.addresses[0]
        near.connect(address)
        assert near.paths() == {address: "same-host"}
        relay = Relay(address)
        try:
            with Session() as far:
                far.connect(relay.address)
                assert far.paths() == {relay.address: "tcp"}
        finally:
            relay.close()
        monkeypatch.setenv(localpath.ENV, "tcp")
        with Session() as forced:
            forced.connect(address)
            assert forced.paths() == {address: "tcp"}


@pytest.mark.parametrize("same_host", ["1", "tcp"])
def test_batches_are_exact_on_both_paths_and_mixed(monkeypatch, same_host):
    """Every sample once, each intact, with torch's DataLoader as the oracle for the order:
    one same-host worker and one reached through a relay (TCP) in one dataset."""
    monkeypatch.setenv(localpath.ENV, same_host)
    torch.manual_seed(3)
    expected = [y for _x, y in torch.utils.data.DataLoader(Filled(200), batch_size=16)]
    with LocalWorkers(2) as workers:
        relay = Relay(workers.addresses[1])
        try:
            ds = RemoteDataset([workers.addresses[0], relay.address], Filled, 200)
            loader = RemoteDataLoader(ds, batch_size=16)
            for _ in range(2):
                seen, intact = one_epoch(loader)
                assert intact
                assert seen == torch.cat(expected).tolist()
            paths = torchfeed.client.paths()
            assert paths[workers.addresses[0]] == ("same-host" if same_host == "1" else "tcp")
            assert paths[relay.address] == "tcp"
        finally:
            relay.close()


def test_slots_are_freed_with_the_batches_and_with_the_connection():
    """The trainer maps a slot once and lets it go when the batch is freed; the worker reuses
    it; closing the connection unmaps everything the trainer no longer holds."""
    with LocalWorkers(1) as workers:
        worker_pid = workers.processes[0].pid
        ds = RemoteDataset(workers.addresses, Filled, 64 * 6)
        loader = RemoteDataLoader(ds, batch_size=64)
        seen, intact = one_epoch(loader)
        assert intact and sorted(seen) == list(range(64 * 6))
        held = slot_maps(worker=worker_pid)
        assert held, "no batch came through shared memory"
        one_epoch(loader)  # a second epoch reuses the slots: no new mapping per batch
        assert len(slot_maps(worker=worker_pid)) <= len(held) + 2
        kept = next(iter(loader))  # a batch the trainer still holds
        torchfeed.client.default_session().close()
        gc.collect()
        assert slot_maps(worker=worker_pid)  # the held batch keeps its slot mapped ...
        assert kept[0][:, 0, 0, 0].tolist() == kept[1].float().tolist()  # ... and readable
        del kept
        gc.collect()
        assert slot_maps(worker=worker_pid) == []
        assert wait_for(lambda: slot_fds(worker_pid) == 0 and slot_maps(worker_pid) == [], timeout=60), (
            "the worker let its slots go"
        )


def test_a_worker_killed_mid_epoch_loses_nothing_and_its_slots_go_with_its_batches():
    with LocalWorkers(2) as workers:
        pids = [p.pid for p in workers.processes]
        ds = RemoteDataset(workers.addresses, Filled, 64 * 8)
        loader = RemoteDataLoader(ds, batch_size=32)
        seen = []
        for step, (x, y) in enumerate(loader):
            assert (x[:, 0, 0, 0] == y.float()).all()
            seen += y.tolist()
            if step == 2:
                workers.kill(1)
        assert sorted(seen) == list(range(64 * 8))
        del x, y
        gc.collect()
        torchfeed.client.default_session().close()
        gc.collect()
        assert [slot_maps(worker=pid) for pid in pids] == [[], []]


_TRAINER = textwrap.dedent(
    """
    import sys, torch, torchfeed
    sys.path.insert(0, {tests!r})
    from test_same_host import Filled
    ds = torchfeed.RemoteDataset([{address!r}], Filled, 64 * 100)
    held = []
    for x, y in torchfeed.RemoteDataLoader(ds, batch_size=64):
        held.append(x)
        if len(held) == 3:
            print("holding", flush=True)
            sys.stdin.read()
    """
)


def test_nothing_is_left_after_either_side_is_killed(tmp_path):
    """kill -9 of the trainer: the worker drops the connection and closes its slots. kill -9
    of the worker: nothing of it stays in the filesystem (memfds and abstract sockets have no
    file), and the trainer's mappings go with its batches."""
    before = set(os.listdir("/dev/shm"))
    worker = subprocess.Popen(
        [sys.executable, "-m", "torchfeed", "worker", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        address = worker.stdout.readline().strip()
        trainer = subprocess.Popen(
            [sys.executable, "-c", _TRAINER.format(tests=os.path.dirname(__file__), address=address)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert trainer.stdout is not None
            assert trainer.stdout.readline().strip() == "holding"
            assert slot_maps(trainer.pid) and slot_fds(worker.pid)
        finally:
            trainer.kill()
            trainer.wait()
        assert wait_for(lambda: slot_fds(worker.pid) == 0, timeout=60), (
            "the worker closed the killed trainer's slots"
        )
        assert wait_for(lambda: slot_maps(worker.pid) == [], timeout=60), (
            "the worker unmapped the killed trainer's slots"
        )
        with Session() as session:  # and it still serves
            session.connect(address)
            assert session.paths() == {address: "same-host"}
    finally:
        worker.kill()
        worker.wait()
    # (other processes of the machine may come and go in /dev/shm: only ours are judged)
    assert not [name for name in set(os.listdir("/dev/shm")) - before if "torch" in name]
    with socket.socket(socket.AF_UNIX) as probe:
        with pytest.raises(ConnectionRefusedError):
            probe.connect(localpath.name_of("127.0.0.1", int(address.rsplit(":", 1)[1])))


def test_the_block_budget_bounds_shared_memory_and_loses_nothing():
    """A trainer holding more batches than the worker's --shm-bytes allows: the rest travel
    through the socket (one warning naming the option), every sample intact."""
    budget = 48 << 20
    with LocalWorkers(
        1, extra_args=["--shm-bytes", str(budget)], env={"PYTHONWARNINGS": "ignore"}
    ) as workers:
        ds = RemoteDataset(workers.addresses, Filled, 64 * 8)
        held = list(RemoteDataLoader(ds, batch_size=64))
        ys = [y for _x, y in held]
        assert sorted(torch.cat(ys).tolist()) == list(range(64 * 8))
        assert all((x[:, 0, 0, 0] == y.float()).all() for x, y in held)
        mine = slot_maps(workers.processes[0].pid)  # the worker's: this connection's slots only
        assert mine, "nothing went through shared memory"
        assert sum(mine) <= budget + len(mine) * (shm.HEAD + 4096)  # (a mapping rounds up to pages)


def test_another_user_gets_nothing_from_the_same_host_socket(other_user):
    """A process of another uid that connects to a worker's same-host socket is closed
    before the worker sends a byte."""
    uid, gid = other_user
    with LocalWorkers(1) as workers:
        port = int(workers.addresses[0].rsplit(":", 1)[1])
        name = localpath.name_of("127.0.0.1", port)
        probe = (
            f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({name!r}); s.settimeout(30); "
            "print(len(s.recv(100)))"
        )
        out = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "0"  # end of stream: no HELLO, nothing
        # this user is still served there
        with Session() as session:
            session.connect(workers.addresses[0])
            assert session.paths() == {workers.addresses[0]: "same-host"}


def _squat(uid: int, gid: int, name: bytes) -> int:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX)
            s.bind(name)
            s.listen()
            os.write(w, b"1")
            signal.pause()
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    return pid


def test_a_name_squatted_by_another_user_is_not_trusted(other_user: tuple[int, int]):
    """Another user binds the same-host name of a port before the worker does: the worker
    offers no same-host path, and the trainer, seeing the squatter's uid, uses TCP."""
    from torchfeed.worker.server import WorkerServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    squatter = _squat(*other_user, localpath.name_of("127.0.0.1", port))
    try:
        server = WorkerServer("127.0.0.1", port).start()
        try:
            assert server.same_host_listener is None
            with Session() as session:
                session.connect(server.address)
                assert session.paths() == {server.address: "tcp"}
        finally:
            server.stop()
    finally:
        os.kill(squatter, signal.SIGKILL)
        os.waitpid(squatter, 0)


_SMALL_SHM = textwrap.dedent(
    """
    import os, sys, torch, torchfeed
    sys.path.insert(0, {tests!r})
    from test_same_host import Filled, one_epoch
    assert os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize == 16 << 20
    with torchfeed.LocalWorkers(2) as workers:
        ds = torchfeed.RemoteDataset(workers.addresses, Filled, 64 * 4)
        seen, intact = one_epoch(torchfeed.RemoteDataLoader(ds, batch_size=64))
        assert intact and sorted(seen) == list(range(64 * 4)), seen
        assert set(torchfeed.client.paths().values()) == {{"same-host"}}
    print("ok")
    """
)


def test_a_small_dev_shm_does_not_matter(tmp_path):
    """Docker's /dev/shm is 64 MiB; here a 16 MiB one, in a private mount namespace, under
    38.5 MB batches: slots are memfds, not files in /dev/shm."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a private mount namespace")
    script = tmp_path / "small_shm.py"
    script.write_text(_SMALL_SHM.format(tests=os.path.dirname(__file__)))
    run = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} {script}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode != 0 and "unshare failed" in run.stderr:
        pytest.skip(f"no private mount namespace here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


def test_heartbeats_keep_a_long_call_alive_on_the_same_host_path():
    """A call that runs far longer than the heartbeat timeout: PONGs count as life here too."""
    with LocalWorkers(1) as workers, Session(heartbeat_interval=0.2, heartbeat_timeout=1.0) as session:
        got = session.rpc_async(workers.addresses[0], time.sleep, args=(3.0,), timeout=60).wait()
        assert got is None
        assert session.paths() == {workers.addresses[0]: "same-host"}


def test_a_forked_child_dropping_its_copy_of_a_batch_does_not_free_the_parents():
    """A child forked while the trainer holds a batch (an evaluation loader's workers, a
    subprocess) and that frees its copy must not hand the batch's slot back to the worker."""
    with LocalWorkers(1) as workers:
        loader = RemoteDataLoader(RemoteDataset(workers.addresses, Filled, 64 * 8), batch_size=64)
        it = iter(loader)
        held_x, held_y = next(it)
        expected = held_y.float().clone()
        pid = os.fork()
        if pid == 0:  # the child: drop everything it inherited, collect, leave
            try:
                del held_x, held_y, it
                gc.collect()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        rest = [y for _x, y in it]  # the worker fills the slots it believes free
        assert len(rest) == 7
        assert torch.equal(held_x[:, 0, 0, 0], expected) and torch.equal(held_x[:, -1, -1, -1], expected)


def slot_ranges() -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:torchfeed-slot" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi))
    return ranges


def test_with_pin_memory_batches_are_copied_out_of_the_slots(monkeypatch):
    """A copy to the GPU with non_blocking=True may still read a batch after its tensor is
    freed: a batch in a slot would be overwritten by the worker's next one. So pinned
    batches are copies in page-locked memory and every slot goes back at once. CUDA cannot
    run here: its page-locked allocation is replaced by ordinary memory (the one mock of
    this file)."""
    import numpy as np

    from torchfeed.protocol import buffers

    monkeypatch.setattr(buffers, "cuda_pinnable", lambda: True)
    monkeypatch.setattr(buffers, "_pinned", lambda n: np.empty(n, dtype=np.uint8))
    with LocalWorkers(1) as workers:
        loader = RemoteDataLoader(
            RemoteDataset(workers.addresses, Filled, 64 * 6), batch_size=64, pin_memory=True
        )
        held = list(loader)  # every batch of the epoch, held
        ranges = slot_ranges()
        assert ranges, "no batch came through shared memory"
        for x, y in held:
            assert torch.equal(x[:, 0, 0, 0], y.float())
            assert not any(lo <= x.data_ptr() < hi for lo, hi in ranges)
        assert len(slot_maps(workers.processes[0].pid)) <= 3  # reused while the batches are held
