"""A worker shared by several trainers: calls are served in turn across connections, and
the bounds hold for all connections together (real worker processes, real sockets).

* one trainer's backlog does not starve another trainer's call (round-robin executors);
* the per-worker bounds on calls held and their size answer with errors naming the option;
* headers announcing huge calls, sent by a peer that holds the secret and then stalls,
  cost the worker no memory (it grows receive buffers as records arrive).
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time

import pytest

import torchfeed
from helpers import PROMPT, wait_for
from torchfeed import client
from torchfeed.protocol import auth, wire
from torchfeed.worker.fair import FairQueue

pytestmark = pytest.mark.timeout(120)


_ran = 0  # in the worker process: stamped_sleep calls started (one executor: no race)


def stamped_sleep(seconds: float) -> float:
    global _ran
    _ran += 1
    time.sleep(seconds)
    return time.monotonic()


def calls_ran() -> int:
    return _ran


def test_fair_queue_takes_connections_in_turn_and_each_in_order():
    q = FairQueue()
    for i in range(3):
        q.put("a", ("a", i))
    q.put("b", ("b", 0))
    q.put("c", ("c", 0))
    q.put("b", ("b", 1))
    taken = [q.get() for _ in range(4)]
    assert taken == [("a", 0), ("b", 0), ("c", 0), ("a", 1)]
    assert q.drop("a") == [("a", 2)] and q.drop("a") == []
    assert q.get() == ("b", 1) and len(q) == 0
    q.put("d", ("d", 0))
    assert q.close() == [("d", 0)]
    assert q.get() is None and not q.put("d", ("d", 1))  # closed: executors leave


def test_a_trainer_with_a_backlog_does_not_starve_another(fresh_workers):
    w = fresh_workers(1, parallel=1)
    address = w.addresses[0]
    with client.Session() as other:  # trainer B: its own session, its own connection
        assert other.rpc_async(address, os.getpid, timeout=30).wait() == w.processes[0].pid
        assert torchfeed.rpc_async(address, os.getpid, timeout=30).wait() > 0  # trainer A connected
        backlog = [torchfeed.rpc_async(address, stamped_sleep, args=(0.05,), timeout=120) for _ in range(400)]
        assert wait_for(lambda: backlog[0].done(), timeout=30)  # A's calls are running
        done_before = sum(f.done() for f in backlog)
        b_ran_at = other.rpc_async(address, stamped_sleep, args=(0.0,), timeout=60).wait()
        # A's calls that ran before B's, by the worker's clock (the first after it is done soon)
        ahead = 0
        while ahead < len(backlog) and backlog[ahead].wait() < b_ran_at:
            ahead += 1
    # B was served between A's calls, not after A's 20 s backlog: only the calls that ran while
    # B's request travelled got ahead of it (a few, or more on a loaded machine; never most)
    assert ahead - done_before < (len(backlog) - done_before) // 2, (done_before, ahead)
    # A's own calls still start in the order they were sent (one FIFO per connection)
    stamps = [f.wait() for f in backlog[:20]]
    assert stamps == sorted(stamps)
    # A goes away: its queued calls are dropped, never run. Until they are, each call of a third
    # trainer lets one of them run (served in turn): two counts in a row then differ.
    client.close_connections([address])
    with client.Session() as third:

        def ran() -> int:
            return third.rpc_async(address, calls_ran, timeout=PROMPT).wait()

        assert wait_for(lambda: ran() == ran(), timeout=PROMPT)
        assert ran() < 1 + len(backlog), "A's queued calls ran after its connection closed"


def test_bounds_on_all_connections_together(fresh_workers):
    w = fresh_workers(
        1,
        parallel=1,
        extra_args=["--max-worker-queued-requests", "3", "--max-worker-queued-bytes", "1500000"],
    )
    address = w.addresses[0]
    with client.Session() as a, client.Session() as b:
        for s in (a, b):  # both connected
            assert s.rpc_async(address, os.getpid, timeout=30).wait() > 0
        # calls: A holds two (one running, one waiting) and B one; B's next one is refused
        held = [a.rpc_async(address, time.sleep, args=(1.0,), timeout=30) for _ in range(2)]
        time.sleep(0.3)  # the worker has read them
        ok = b.rpc_async(address, time.sleep, args=(1.0,), timeout=30)
        time.sleep(0.3)
        with pytest.raises(torchfeed.TorchfeedError, match="--max-worker-queued-requests"):
            b.rpc_async(address, os.getpid, timeout=30).wait()
        for f in [*held, ok]:
            f.wait()
        assert b.rpc_async(address, os.getpid, timeout=30).wait() > 0  # room again
        # bytes: A's call of 1 MB runs, B's call of 1 MB would take the total over 1.5 MB
        big = a.rpc_async(address, stamped_sleep_len, args=(b"x" * 1_000_000, 0.5), timeout=30)
        time.sleep(0.2)
        with pytest.raises(torchfeed.TorchfeedError, match="--max-worker-queued-bytes"):
            b.rpc_async(address, len, args=(b"y" * 1_000_000,), timeout=30).wait()
        assert big.wait() == 1_000_000
        assert b.rpc_async(address, len, args=(b"y" * 1_000_000,), timeout=30).wait() == 1_000_000


def stamped_sleep_len(data: bytes, seconds: float) -> int:
    time.sleep(seconds)
    return len(data)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def stalled_call(address: str, meta_len: int, buffer_len: int = 0):
    """An authenticated connection that announces a CALL of about ``meta_len +
    buffer_len`` bytes (header, length table, meta when small) and then sends nothing."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    chan = auth.client_handshake(sock, auth.load_secret(), address)
    chan.send_record(wire.pack_fixed(wire.CALL, 1, meta_len, 1 if buffer_len else 0))
    if buffer_len:
        chan.send_record(struct.pack("<Q", buffer_len))
        if meta_len <= 64:
            chan.send_record(b"m" * meta_len)  # the meta arrives: the buffer block is allocated
    return sock, chan


def test_stalled_headers_announcing_huge_calls_cost_no_memory(fresh_workers):
    w = fresh_workers(1, extra_args=["--max-worker-queued-bytes", str((3 << 30) + (64 << 20))])
    address, pid = w.addresses[0], w.processes[0].pid
    assert torchfeed.rpc_async(address, os.getpid, timeout=30).wait() == pid
    before = rss_mib(pid)
    gib = (1 << 30) - 4096
    conns = [stalled_call(address, gib), stalled_call(address, gib), stalled_call(address, 16, gib)]
    try:
        time.sleep(1.5)  # the worker has read the three headers and waits for their bytes
        grew = rss_mib(pid) - before
        assert grew < 200, f"the worker's memory grew by {grew:.0f} MiB for calls whose bytes never came"
        # the stalled calls hold the worker's budget: one more is answered with the knob to raise
        sock, chan = stalled_call(address, gib)
        conns.append((sock, chan))
        sock.settimeout(30)
        frame = chan.read_frame(wire.Limits())
        assert frame.kind == wire.ERROR and frame.request_id == 1
        assert "--max-worker-queued-bytes" in str(pickle.loads(frame.meta))
        # honest clients are still served, large calls and replies (multi-record meta) included
        text = "t" * (3 << 20)  # a str travels in the pickled meta, over many records
        assert torchfeed.rpc_async(address, str.upper, args=(text,), timeout=30).wait() == text.upper()
        payload = b"p" * (8 << 20)  # large bytes travel as a buffer
        assert torchfeed.rpc_async(address, len, args=(payload,), timeout=30).wait() == len(payload)
        assert rss_mib(pid) - before < 200
    finally:
        for sock, _ in conns:
            sock.close()
