"""Floods of idle connections against the metrics ports (``torchfeed worker --metrics-port``,
``torchfeed.metrics.serve``): the process keeps a bounded number of threads, a scrape from
another source is still answered, and the loader still works.

A flood is 200 connections from 127.0.0.2 that never send a byte, held by the test and not
replaced when dropped. Before the metrics servers were bounded each connection held a thread
for as long as the peer kept it open.

The thread-limit test puts a worker in a cgroup of its own with a low ``pids.max`` (what a
Kubernetes pod's PID limit is); it skips where no pids cgroup can be made (not root, or no
writable pids controller). RLIMIT_NPROC would be simpler but root ignores it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import PROMPT, RangeDataset, wait_for
from torchfeed import LocalWorkers, RemoteDataLoader, RemoteDataset, Session
from torchfeed.util import free_port

prometheus_client = pytest.importorskip("prometheus_client")

import torchfeed.metrics as metrics  # noqa: E402

FLOOD = 200  # idle connections held at once
N = 40  # samples per pass
# threads a flood may add: a handler per connection served, boundedhttp.MAX_HANDLERS (the
# accepting thread exists before)
FLOOD_THREADS = 8
SLACK = 4  # threads a process may start or end meanwhile for its own reasons


@contextmanager
def flooding(port: int, n: int = FLOOD, source: str = "127.0.0.2"):
    """``n`` connections to 127.0.0.1:``port`` from ``source`` that never send a byte, held
    until the block ends; yields a function: how many of them the server has closed or
    answered (a 503) so far."""
    held: list[socket.socket] = []

    def dropped() -> int:
        count = 0
        for s in held:
            try:
                s.recv(4096)  # b"": closed; else the start of a 503
                count += 1
            except BlockingIOError:
                pass  # still open and silent
            except OSError:
                count += 1  # reset
        return count

    try:
        for _ in range(n):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
            except OSError:
                continue  # the backlog was full: one fewer
            s.setblocking(False)
            held.append(s)
        assert len(held) > n // 2, f"only {len(held)} of {n} connections were made"
        yield dropped
    finally:
        for s in held:
            s.close()


def scrape(url: str) -> int:
    """The status of one GET (a 503 is returned, not raised)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def most_threads(count, rounds: int = 30) -> int:
    """The largest of ``rounds`` readings of ``count()``, 0.1 s apart (the flood's connections
    arrive meanwhile)."""
    seen = 0
    for _ in range(rounds):
        seen = max(seen, count())
        time.sleep(0.1)
    return seen


def task_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def one_batch(address: str) -> list:
    """A dataset built on ``address`` over a connection of its own, and its first batch."""
    with Session(timeout=30) as session:
        loader = RemoteDataLoader(RemoteDataset([address], RangeDataset, N, session=session), batch_size=8)
        return next(iter(loader))


@pytest.mark.slow
def test_worker_metrics_port_survives_a_flood_of_idle_connections():
    port = free_port()
    with LocalWorkers(1, extra_args=["--metrics-port", str(port)]) as workers:
        pid = workers.processes[0].pid
        assert scrape(f"http://127.0.0.1:{port}/metrics") == 200
        assert len(one_batch(workers.addresses[0])[1]) == 8
        before = task_count(pid)
        with flooding(port) as dropped:
            assert wait_for(lambda: dropped() >= FLOOD // 2, timeout=30), f"the worker dropped {dropped()}"
            during = most_threads(lambda: task_count(pid))
            assert during <= before + FLOOD_THREADS + SLACK, (before, during)
            assert scrape(f"http://127.0.0.1:{port}/metrics") == 200  # another source gets in
            assert len(one_batch(workers.addresses[0])[1]) == 8  # and so does a trainer
            assert workers.processes[0].poll() is None
        assert scrape(f"http://127.0.0.1:{port}/metrics") == 200


@pytest.mark.slow
def test_trainer_metrics_server_survives_a_flood_of_idle_connections():
    with LocalWorkers(1) as workers:
        loader = RemoteDataLoader(RemoteDataset(workers.addresses, RangeDataset, N), batch_size=8)
        assert sum(len(b[1]) for b in loader) == N
        with metrics.serve(loader, port=0) as served:
            before = threading.active_count()
            with flooding(served.port) as dropped:
                assert wait_for(lambda: dropped() >= FLOOD // 2, timeout=30), (
                    f"the server dropped {dropped()}"
                )
                during = most_threads(threading.active_count)
                assert during <= before + FLOOD_THREADS + SLACK, (before, during)
                assert scrape(served.url) == 200  # another source gets in
                assert sum(len(b[1]) for b in loader) == N  # the next epoch
            assert scrape(served.url) == 200


def _eof_within(sock, seconds: float) -> bool:
    """Whether the peer closes ``sock`` (EOF or reset) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _connect_from(source: str, port: int) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


@pytest.mark.slow
def test_silent_and_dripping_clients_are_dropped():
    """A client that sends nothing, and one that sends a byte every 0.1 s (each read well within
    the timeout), are both closed by the server; a whole request is then answered."""
    registry = prometheus_client.CollectorRegistry()
    with metrics.MetricsServer(registry, 0, "127.0.0.1", read_timeout=0.5) as served:
        silent = _connect_from("127.0.0.1", served.port)
        dripping = _connect_from("127.0.0.1", served.port)
        try:
            assert _eof_within(silent, 30)
            request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 300
            closed = False
            for byte in request:  # 30 s of drip at most: far beyond the 0.5 s the head may take
                try:
                    dripping.send(bytes([byte]))
                except OSError:
                    closed = True
                    break
                time.sleep(0.1)
            assert closed or _eof_within(dripping, 1)
        finally:
            silent.close()
            dripping.close()
        assert wait_for(lambda: scrape(served.url) == 200, PROMPT, interval=0.2)  # handlers free again


def test_connections_beyond_the_caps_are_answered_503_and_closed():
    """Two handlers, one per source: a second connection from a source, and any connection
    while both handlers are busy, get a 503 and are closed while the first two stay open."""
    registry = prometheus_client.CollectorRegistry()
    with metrics.MetricsServer(
        registry, 0, "127.0.0.1", max_handlers=2, per_source=1, read_timeout=60
    ) as served:
        held = [_connect_from("127.0.0.2", served.port), _connect_from("127.0.0.3", served.port)]
        try:
            for source in ("127.0.0.2", "127.0.0.4"):  # over its source's cap; over the total cap
                extra = _connect_from(source, served.port)
                held.append(extra)
                extra.settimeout(10)
                assert extra.recv(200).startswith(b"HTTP/1.0 503"), source
                assert _eof_within(extra, 10), source
            assert served.refused == 2
            assert not _eof_within(held[0], 0.2)  # the first two are still being served
        finally:
            for s in held:
                s.close()
        # their handlers are free again once they read the closes (their threads, on their time)
        assert wait_for(lambda: scrape(served.url) == 200, PROMPT, interval=0.2)


# --- a pod's PID limit: the pids cgroup -------------------------------------------------------

PIDS = Path("/sys/fs/cgroup/pids")


@pytest.fixture
def pids_cgroup():
    """A new pids cgroup (v1) to put a worker in; removed after its processes are gone."""
    group = PIDS / f"torchfeed-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a pids cgroup ({exc}): the thread-limit test needs root and cgroup v1 pids")
    try:
        yield group
    finally:
        for _ in range(100):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _worker_in(group: Path, metrics_port: int) -> subprocess.Popen:
    def join() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    cmd = [sys.executable, "-m", "torchfeed", "worker", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--metrics-port", str(metrics_port)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, preexec_fn=join)


@pytest.mark.slow
def test_a_flood_does_not_use_up_a_pid_limited_worker(pids_cgroup):
    """The worker runs under a PID limit a little above what serving a trainer takes (plus the
    metrics handlers); a flood of idle metrics connections leaves it able to serve a new trainer.
    Before, each connection took a thread until the limit, and trainers were refused."""
    port = free_port()
    proc = _worker_in(pids_cgroup, port)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, "the worker did not start"
        assert len(one_batch(address)[1]) == 8
        serving = int((pids_cgroup / "pids.current").read_text())
        (pids_cgroup / "pids.max").write_text(str(serving + FLOOD_THREADS + SLACK + 8))
        with flooding(port) as dropped:
            assert wait_for(lambda: dropped() >= FLOOD // 2, timeout=30), f"the worker dropped {dropped()}"
            assert len(one_batch(address)[1]) == 8  # a new trainer, a new connection
            assert scrape(f"http://127.0.0.1:{port}/metrics") == 200
            assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
