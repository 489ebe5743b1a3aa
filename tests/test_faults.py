"""Fault tolerance: workers die, hang, lose their network, join, leave, misbehave."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import torchfeed
from helpers import PROMPT, PidDataset, PoisonDataset, RangeDataset, wait_for
from torchfeed import client


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def collect(loader, on_batch=None):
    """All batches of one pass as (index, pid) rows; on_batch(i) runs after batch i. Also the
    warnings and the torchfeed.workers log lines (membership events) said meanwhile."""
    rows = []
    logger, records = logging.getLogger("torchfeed.workers"), _Records()
    logger.addHandler(records)
    level, logger.level = logger.level, logging.INFO
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, b in enumerate(loader):
                rows.append(b)
                if on_batch:
                    on_batch(i)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return torch.cat(rows), [str(w.message) for w in caught] + records.messages


@pytest.fixture
def fast_heartbeat():
    session = client.default_session()
    old = session.heartbeat_interval, session.heartbeat_timeout
    torchfeed.set_heartbeat(0.2, 1.5)
    yield
    torchfeed.set_heartbeat(*old)


@pytest.mark.slow
@pytest.mark.parametrize("kills", [1, 2])
def test_killed_workers_lose_nothing(fresh_workers, kills):
    w = fresh_workers(4)
    ds = torchfeed.RemoteDataset(w.addresses, PidDataset, 200, 0.002)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4)
    victims = list(range(kills))

    def kill(i):
        if i == 5:
            for v in victims:
                w.kill(v)

    rows, warned = collect(loader, kill)
    assert rows[:, 0].tolist() == list(range(200))  # every sample once, in order
    for v in victims:
        assert any(w.addresses[v] in m for m in warned), warned
    dead = {w.processes[v].pid for v in victims}
    # a batch a victim finished before it was killed may still be delivered: it was received,
    # up to the scheduler's widest reorder window ahead (4 x 4 workers x 2 credits) of batch 5
    assert loader.prefetch_factor is not None
    ahead = 4 * len(w.addresses) * loader.prefetch_factor
    assert not dead & set(rows[(6 + ahead) * 4 :, 1].tolist())


@pytest.mark.slow
def test_stopped_worker_detected_by_heartbeat(fresh_workers, fast_heartbeat):
    w = fresh_workers(3)
    ds = torchfeed.RemoteDataset(w.addresses, PidDataset, 120, 0.005)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4, straggler_factor=None)  # heartbeats alone
    stopped = {}

    def stop(i):
        if i == 3:
            w.kill(0, signal.SIGSTOP)
            stopped["at"] = time.monotonic()

    try:
        rows, warned = collect(loader, stop)
    finally:
        w.kill(0, signal.SIGCONT)
    assert rows[:, 0].tolist() == list(range(120))
    # lost by the heartbeat's verdict (nothing else ends a wait on a stopped process)
    assert any(w.addresses[0] in m and "no heartbeat" in m for m in warned), warned


@pytest.mark.slow
def test_long_getitem_is_not_a_hang(fresh_workers, fast_heartbeat):
    w = fresh_workers(1)
    ds = torchfeed.RemoteDataset(w.addresses, PidDataset, 2, 2.5)  # 2.5 s per item > 1.5 s timeout
    rows, warned = collect(torchfeed.RemoteDataLoader(ds, batch_size=1))
    assert rows[:, 0].tolist() == [0, 1]
    assert not warned


def _netns_available() -> str:
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = subprocess.run(["ip", "netns", "add", f"tfprobe{os.getpid()}"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` is not permitted here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"tfprobe{os.getpid()}"], capture_output=True)
    return ""


@pytest.fixture
def netns_worker():
    """A worker in its own network namespace, reached over a veth pair we can cut."""
    reason = _netns_available()
    if reason:
        pytest.skip(reason)
    tag = os.getpid() % 10000
    ns, host_if, ns_if = f"tfns{tag}", f"tfh{tag}", f"tfw{tag}"
    octet = 1 + tag % 250
    host_ip, ns_ip = f"10.251.{octet}.1", f"10.251.{octet}.2"
    cmds = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", f"{host_ip}/30", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if],
        ["ip", "netns", "exec", ns, "ip", "link", "set", ns_if, "up"],
        ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"],
    ]
    proc = None
    try:
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True)
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "torchfeed",
                "worker",
                "--host",
                ns_ip,
                "--port",
                "0",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith(ns_ip), address
        yield address, (lambda: subprocess.run(["ip", "link", "set", host_if, "down"], check=True))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.slow
def test_network_cut_detected(fresh_workers, netns_worker, fast_heartbeat):
    address, cut = netns_worker
    w = fresh_workers(2)
    ds = torchfeed.RemoteDataset([address, *w.addresses], PidDataset, 120, 0.005)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4, straggler_factor=None)  # heartbeats alone
    rows, warned = collect(loader, lambda i: cut() if i == 3 else None)
    assert rows[:, 0].tolist() == list(range(120))
    assert any(address in m and "no heartbeat" in m for m in warned), warned


@pytest.mark.slow
def test_restarted_worker_is_used_again(fresh_workers):
    w = fresh_workers(2)
    n = 1000  # the epoch outlasts the restart (a few seconds) plus the reconnect backoff
    ds = torchfeed.RemoteDataset(w.addresses, PidDataset, n, 0.004)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2)
    old_pid = w.processes[0].pid
    new_pid = {}

    def restart(i):
        if i == 4:
            w.kill(0)
            w.processes[0].wait()
            w.restart(0)  # same port
            new_pid["pid"] = w.processes[0].pid

    rows, _ = collect(loader, restart)
    assert rows[:, 0].tolist() == list(range(n))
    pids = rows[:, 1].tolist()
    assert old_pid in pids and new_pid["pid"] in pids  # the new process got work in the same epoch


@pytest.mark.slow
def test_add_workers_mid_epoch(fresh_workers):
    first, later = fresh_workers(1), fresh_workers(2)
    ds = torchfeed.RemoteDataset(first.addresses, PidDataset, 200, 0.004)
    rows, _ = collect(
        torchfeed.RemoteDataLoader(ds, batch_size=2),
        lambda i: ds.add_workers(later.addresses) if i == 2 else None,
    )
    assert rows[:, 0].tolist() == list(range(200))
    assert {p.pid for p in later.processes} <= set(rows[:, 1].tolist())


@pytest.mark.slow
def test_workers_file_is_watched(fresh_workers, tmp_path):
    first, later = fresh_workers(1), fresh_workers(1)
    path = tmp_path / "workers"
    path.write_text(first.addresses[0] + "\n")
    ds = torchfeed.RemoteDataset.from_file(str(path), PidDataset, 200, 0.004)

    def register(i):
        if i == 2:
            with open(path, "a") as f:
                f.write(later.addresses[0] + "\n")

    rows, _ = collect(torchfeed.RemoteDataLoader(ds, batch_size=2), register)
    assert rows[:, 0].tolist() == list(range(200))
    assert later.processes[0].pid in rows[:, 1].tolist()
    assert ds.workers == [first.addresses[0], later.addresses[0]]
    ds.close()


@pytest.mark.slow
def test_remove_worker_drains_it(fresh_workers):
    w = fresh_workers(2)
    ds = torchfeed.RemoteDataset(w.addresses, PidDataset, 160, 0.004)
    rows, _ = collect(
        torchfeed.RemoteDataLoader(ds, batch_size=2),
        lambda i: ds.remove_workers([w.addresses[0]]) if i == 3 else None,
    )
    assert rows[:, 0].tolist() == list(range(160))
    assert w.processes[0].pid not in rows[40:, 1].tolist()


@pytest.mark.slow
def test_all_workers_gone_raises_after_timeout(fresh_workers):
    w = fresh_workers(2)
    ds = torchfeed.RemoteDataset(w.addresses, PidDataset, 400, 0.005)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2, timeout=2)
    t0 = time.monotonic()
    with pytest.raises(torchfeed.WorkerLost) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, _ in enumerate(loader):
            if i == 2:
                w.kill(0)
                w.kill(1)
    assert time.monotonic() - t0 < 2 + PROMPT  # the loader's timeout, not a hang
    for a in w.addresses:
        assert a in str(info.value) and a in info.value.errors


@pytest.mark.slow
def test_poison_sample_gives_up_and_names_it(fresh_workers, caplog):
    w = fresh_workers(4)
    ds = torchfeed.RemoteDataset(w.addresses, PoisonDataset, 60, 21, 0.002)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4, max_retries=2)
    with pytest.raises(torchfeed.PoisonSampleError) as info, caplog.at_level(logging.INFO, "torchfeed"):
        list(loader)
    assert 21 in info.value.indices
    assert "max_retries=2" in str(info.value)
    # one log line for the poison batch and one per worker it killed; counted in stats
    assert [r.levelno for r in caplog.records if r.name == "torchfeed.poison"] == [logging.ERROR]
    assert len([r for r in caplog.records if "lost worker" in r.getMessage()]) == 3
    assert sum(s.state == "lost" for s in loader.stats().workers.values()) >= 1
    # tried on 3 workers, not more (a process closes its sockets a moment before it is reaped)
    assert wait_for(lambda: sum(p.poll() is not None for p in w.processes) == 3)
    time.sleep(0.3)
    assert sum(p.poll() is not None for p in w.processes) == 3


def test_connection_closed_on_purpose_blames_no_batch(fresh_workers):
    """Closing a connection mid-pass (close_connections, LocalWorkers.close) says nothing
    about the batch the worker was running: with max_retries=0 a single blamed loss would be
    a PoisonSampleError (it was, at exit, when LocalWorkers closed under a live pass)."""
    from helpers import SleepDataset

    w = fresh_workers(2)
    ds = torchfeed.RemoteDataset(w.addresses, SleepDataset, 40, 0.02)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4, max_retries=0, timeout=60)
    it = iter(loader)
    got = [next(it)[1]]
    client.close_connections(w.addresses[:1])  # it holds a batch: 20 ms per sample
    got += [b[1] for b in it]
    assert sorted(torch.cat(got).tolist()) == list(range(40))


def test_the_batch_that_killed_the_worker_is_the_one_blamed(fresh_workers):
    """The worker dies in the first sample of batch 5, right after answering batch 4: batch
    4's reply must have left before batch 5 started, or the client, which blames the oldest
    request still running, names the innocent batch 4 (it did when replies of long calls
    were handed to the writer thread while the executor went on)."""
    w = fresh_workers(1)
    for _ in range(3):
        ds = torchfeed.RemoteDataset(w.addresses, PoisonDataset, 40, 20, 0.002)
        loader = torchfeed.RemoteDataLoader(ds, batch_size=4, max_retries=0, timeout=30)
        with pytest.raises(torchfeed.PoisonSampleError) as info:
            list(loader)
        assert info.value.indices == [20, 21, 22, 23]
        w.restart(0)


@pytest.mark.slow
def test_python_exception_is_not_retried(fresh_workers):
    from helpers import FailingDataset

    w = fresh_workers(3)
    ds = torchfeed.RemoteDataset(w.addresses, FailingDataset, 20, bad=[5])
    with pytest.raises(torchfeed.RemoteError):
        list(torchfeed.RemoteDataLoader(ds, batch_size=2))
    assert all(p.poll() is None for p in w.processes)


@pytest.mark.slow
def test_straggler_is_duplicated_and_delivered_once(fresh_workers):
    w = fresh_workers(3)
    slow = w.processes[0].pid
    ds = torchfeed.RemoteDataset(w.addresses, PidDataset, 90, 0.003, {slow: 400})  # 1.2 s per item there
    loader = torchfeed.RemoteDataLoader(ds, batch_size=1, straggler_factor=3)
    rows, _ = collect(loader)
    assert rows[:, 0].tolist() == list(range(90))  # each once, in order
    assert loader.stats().workers[w.addresses[0]].hedged > 0  # the slow one's batches went elsewhere


@pytest.mark.slow
def test_worker_survives_bad_client_and_serves_others(fresh_workers):
    import socket

    w = fresh_workers(1)
    host, port = client.parse_address(w.addresses[0])
    for junk in [b"", b"GET / HTTP/1.0\r\n\r\n", os.urandom(4096)]:
        s = socket.create_connection((host, port))
        s.sendall(junk)
        s.close()
    assert torchfeed.rpc_async(w.addresses[0], lambda: 42).wait() == 42


def _threads_fds():
    """The live threads (as a set: a thread of an earlier test that ends meanwhile is not a
    difference) and the number of open file descriptors."""
    return set(threading.enumerate()), len(os.listdir("/proc/self/fd"))


def _nothing_new(before) -> bool:
    threads, fds = _threads_fds()
    return threads <= before[0] and fds <= before[1]


def test_hundred_loaders_leave_nothing_behind(workers2):
    ds = torchfeed.RemoteDataset(workers2, RangeDataset, 64)
    list(torchfeed.RemoteDataLoader(ds, batch_size=8))  # connections exist before the count
    before = _threads_fds()
    children = subprocess.run(
        ["pgrep", "-P", str(os.getpid())], capture_output=True, text=True
    ).stdout.split()
    for i in range(100):
        loader = torchfeed.RemoteDataLoader(ds, batch_size=8, shuffle=True)
        it = iter(loader)
        next(it)
        if i % 2:
            list(it)
        del it, loader
    # reference releases go out with the next heartbeat tick; pass threads end on their own
    assert wait_for(lambda: _nothing_new(before), timeout=10), (_threads_fds()[0] - before[0], before[1])
    after_children = subprocess.run(
        ["pgrep", "-P", str(os.getpid())], capture_output=True, text=True
    ).stdout.split()
    assert after_children == children


def _rss_kb(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_soak_ten_thousand_batches_memory_flat(fresh_workers):
    w = fresh_workers(2)
    ds = torchfeed.RemoteDataset(w.addresses, RangeDataset, 10**6, 64)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=4, seed=0)
    it = iter(loader)
    pids = [os.getpid(), *(p.pid for p in w.processes)]
    for _ in range(1500):  # warm-up: pools, caches, allocator arenas
        next(it)
    base = [_rss_kb(p) for p in pids]
    for _ in range(10000):
        next(it)
    end = [_rss_kb(p) for p in pids]
    for b, e, p in zip(base, end, pids):
        assert e <= b * 1.10, f"process {p}: RSS grew from {b} kB to {e} kB"


def test_a_worker_that_stops_reading_during_a_send_fails_the_call_once(fresh_workers):
    """A call whose send is cut off by the connection failing (the keeper gives up on a hung
    worker) reports WorkerLost through its future; its send neither blocks for good nor
    completes the future twice ("a completed Future as complete again")."""
    w = fresh_workers(1)
    session = torchfeed.Session(heartbeat_interval=0.5, heartbeat_timeout=2)
    address = w.addresses[0]
    assert session.rpc_async(address, len, args=(b"x",)).wait() == 1
    w.kill(0, signal.SIGSTOP)
    try:
        # far more than the socket buffers hold: the send blocks until the connection fails
        fut = session.rpc_async(address, len, args=(bytes(256 << 20),))
        with pytest.raises(torchfeed.WorkerLost):
            fut.wait()
    finally:
        w.kill(0, signal.SIGCONT)
        session.close()
