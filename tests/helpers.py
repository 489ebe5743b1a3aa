"""Datasets and helpers importable by both the tests and the worker processes."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset


class SizedDataset(Dataset):
    """A map-style dataset of ``n`` samples (a subclass says what sample i is)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n


class RangeDataset(SizedDataset):
    """Sample i is (a float tensor filled with i, the label i)."""

    def __init__(self, n: int, width: int = 3):
        super().__init__(n)
        self.width = width

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.full((self.width,), float(i)), i


class DictDataset(SizedDataset):
    def __getitem__(self, i):
        return {"x": np.arange(4, dtype=np.float32) + i, "name": f"s{i}", "t": (i, torch.tensor([i, -i]))}


class FailingDataset(RangeDataset):
    """Raises on the indices given."""

    def __init__(self, n: int, bad):
        super().__init__(n)
        self.bad = set(bad)

    def __getitem__(self, i):
        if i in self.bad:
            raise KeyError(f"sample {i} is corrupt")
        return super().__getitem__(i)


class SleepDataset(RangeDataset):
    """Each item sleeps; workers whose pid file says 'slow' sleep `factor` times longer."""

    def __init__(self, n: int, seconds: float, slow_pid_factor: dict | None = None, with_pid: bool = False):
        super().__init__(n)
        self.seconds = seconds
        self.slow = slow_pid_factor or {}
        self.with_pid = with_pid

    def __getitem__(self, i):
        time.sleep(self.seconds * self.slow.get(os.getpid(), 1))
        x, y = super().__getitem__(i)
        return (x, y, os.getpid()) if self.with_pid else (x, y)


def indices(n: int) -> Dataset[int]:
    """``range(n)`` as the dataset torch's samplers are typed to take (they only read its length)."""
    return cast("Dataset[int]", range(n))


@contextlib.contextmanager
def named_workers(specs: dict):
    """One LocalWorkers process per name, started concurrently: yields name -> (address, pid)."""
    from concurrent.futures import ThreadPoolExecutor

    from torchfeed import LocalWorkers

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(LocalWorkers, 1, **kw) for name, kw in specs.items()}
    running = [f.result() for f in futures.values() if f.exception() is None]
    try:
        for f in futures.values():
            f.result()  # re-raise a failed start
        yield {name: (f.result().addresses[0], f.result().processes[0].pid) for name, f in futures.items()}
    finally:
        for w in running:  # signal them all first: they shut down concurrently
            for proc in w.processes:
                if proc.poll() is None:
                    proc.terminate()
        for w in running:
            w.close()


def named_workers_fixtures(specs_of):
    """The fixtures of a test module with workers of its own: ``_workers`` (module-scoped, name ->
    (address, pid), started by :func:`named_workers` from the specs ``specs_of(tmp_path_factory)``
    returns) and ``worker``, the one named ``main``. A module binds both:
    ``_workers, worker = named_workers_fixtures(...)``."""
    import pytest

    @pytest.fixture(scope="module", name="_workers")
    def workers(tmp_path_factory):
        with named_workers(specs_of(tmp_path_factory)) as started:
            yield started

    @pytest.fixture(name="worker")
    def main(_workers):
        return _workers["main"]

    return workers, main


# Seconds within which something "prompt" must happen in a test on a busy shared machine: far
# above the milliseconds it takes on a quiet one (the load of other jobs stretches any wait), far
# below a hang (pytest's 120 s). A test asserts a duration only where the behaviour itself is a
# timeout, and then bounds it by this slack, never by how fast the machine happens to be.
PROMPT = 20.0


# `torchfeed worker` on loopback, in a new process (its port and options follow)
WORKER_COMMAND = [sys.executable, "-m", "torchfeed", "worker", "--host", "127.0.0.1"]

# torchfeed.autoscale's settings for the tests' short epochs: they wait for their first batch
# about 5% of the time, so a 20% target keeps that out
FAST_AUTOSCALE: dict[str, Any] = dict(
    target_wait=0.2,
    interval=0.25,
    window=1.5,
    up_cooldown=1.5,
    down_after=2.0,
    down_cooldown=1.0,
    drain_timeout=30,
)


def dask_cluster(n_workers: int = 1, **kw):
    """A quiet ``distributed.LocalCluster`` of worker processes on loopback (one thread each, no
    dashboard); ``kw`` adds to or overrides its arguments."""
    import logging

    from distributed import LocalCluster

    args: dict[str, Any] = dict(
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    return LocalCluster(n_workers=n_workers, **{**args, **kw})


def accept_handshake(sock, same_host: bool = False) -> tuple[Any, bytes]:
    """A worker's side of the handshake on ``sock`` (HELLO, the doorman's verdict, AUTH_OK),
    with the process's secret: the session's keys and every byte received."""
    from torchfeed.protocol import auth, wire
    from torchfeed.worker.doorman import judge

    hello = auth.hello_meta(False)
    wire.send_frame(sock, wire.HELLO, meta=hello)
    received = b""
    while True:
        verdict, reply, keys = judge(received, hello, auth.load_secret(), same_host=same_host)
        if verdict != "more":
            break
        data = sock.recv(4096)
        assert data, "the trainer closed during the handshake"
        received += data
    assert verdict == "ok" and keys is not None, (verdict, reply)
    wire.send_frame(sock, wire.AUTH_OK, meta=reply)
    return keys, received


class FakeWorker:
    """A fake worker on a thread: takes the first connection to ``listener``, completes the real
    handshake (:func:`accept_handshake`) and hands the rest to ``serve``. What ``serve`` raises
    is kept in ``failure`` for the test; ``answered`` is set when it ends. A subclass sets its
    own fields before calling ``__init__`` (the thread starts there)."""

    def __init__(self, listener, same_host: bool = False):
        self.listener = listener
        self.same_host = same_host
        self.answered = threading.Event()
        self.failure: BaseException | None = None
        self._socks: list = []
        threading.Thread(target=self._run, daemon=True).start()

    def serve(self, sock, keys, received: bytes) -> None:
        """After the handshake: ``keys`` are the session's, ``received`` every byte read so far."""
        raise NotImplementedError

    def _run(self) -> None:
        try:
            sock, _ = self.listener.accept()
            self._socks.append(sock)
            keys, received = accept_handshake(sock, same_host=self.same_host)
            self.serve(sock, keys, received)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc
        finally:
            self.answered.set()

    def close(self) -> None:
        self.listener.close()
        for sock in self._socks:
            sock.close()


def listen_on_if_free(sock, port: int, host: str = "127.0.0.1") -> bool:
    """Bind ``sock`` to ``port`` and listen, if the port is free now (a test taking a port a
    worker it killed held, with ``wait_for``)."""
    try:
        sock.bind((host, port))
    except OSError:
        return False
    sock.listen()
    return True


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; return its last value.

    The one polling helper of the tests: wait for a condition with it (``assert wait_for(...)``)
    rather than sleeping a fixed time. An exception raised by ``predicate`` (a failed assertion
    about the state being polled) ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def stop_process(proc, grace: float = 10.0) -> None:
    """End ``proc`` (a ``subprocess.Popen``): SIGTERM, then SIGKILL if it is still running
    ``grace`` seconds later."""
    import subprocess

    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def port_free_on(hosts) -> int:
    """A port free on every address of ``hosts`` now (workers listening on several loopback
    addresses, one port for all, as the pods behind a headless Service do)."""
    import socket

    from torchfeed.util import free_port

    while True:
        candidate = free_port()
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, candidate))
            return candidate
        except OSError:
            continue


def torch_batches(dataset, **kw) -> list:
    """The batches torch's DataLoader yields for ``dataset`` with ``kw``, after
    ``torch.manual_seed(7)`` (as :func:`batches_of` seeds a torchfeed pass)."""
    from torch.utils.data import DataLoader

    torch.manual_seed(7)
    return list(DataLoader(dataset, **kw))


def batches_of(loader, stop: int | None = None, at: int | None = None, event=None) -> list:
    """The batches of a pass of ``loader`` begun after ``torch.manual_seed(7)``: ``event()`` runs
    once ``at`` batches arrived; the pass stops after ``stop`` batches (at the end without)."""
    torch.manual_seed(7)
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == at:
            event()
        if len(out) == stop:
            break
    return out


def elastic_loader(rds, batch_size: int, world: int, rank: int, **kw):
    """Rank ``rank`` of ``world``'s loader of ``rds``: a DistributedSampler without padding (seed
    0), the loader's seed 5; ``kw`` goes to the loader."""
    import torchfeed

    sampler = torchfeed.DistributedSampler(rds, num_replicas=world, rank=rank, seed=0, pad=False)
    return torchfeed.RemoteDataLoader(rds, batch_size, sampler=sampler, seed=5, **kw)


def run_in_segments(make_loader, worlds: list[int], stops: list[int], pick) -> tuple[list, list[list[dict]]]:
    """A job run in segments, its ranks moving in step as DDP moves them: segment k runs the
    loaders ``make_loader(worlds[k], rank)`` for ``stops[k]`` batches each (the last segment to
    the end of the epoch), then saves every rank's state; rank r of segment k resumes from the
    state of the segment before's rank ``pick(k, r, its world)``. A segment in which a rank's
    share runs out goes on to the end of the epoch (without padding the ranks' batch counts can
    differ by one) and is the last. Returns every batch delivered, and each segment's states."""
    delivered: list = []
    saved: list[list[dict]] = []
    for k, world in enumerate(worlds):
        loaders = [make_loader(world, r) for r in range(world)]
        if saved:
            for r, loader in enumerate(loaders):
                loader.load_state_dict(saved[-1][pick(k, r, len(saved[-1]))])
        its = [iter(loader) for loader in loaders]
        last = k == len(worlds) - 1
        step, ending = 0, False
        while last or ending or step < stops[k]:
            got = [next(it, None) for it in its]  # every rank takes one
            ending = ending or any(b is None for b in got)
            if all(b is None for b in got):
                break
            delivered += [b for b in got if b is not None]
            step += 1
        saved.append([loader.state_dict() for loader in loaders])
        if ending:
            break
    return delivered, saved


def deep_equal(a, b) -> bool:
    """Structure, types, dtypes and values all equal."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(deep_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


class RandomAugmentDataset(SizedDataset):
    """Uses Python's, numpy's and torch's global generators in __getitem__ (and sleeps a bit)."""

    def __init__(self, n: int, delay: float = 0.0):
        super().__init__(n)
        self.delay = delay

    def __getitem__(self, i):
        import random

        if self.delay:
            time.sleep(self.delay)
        return torch.tensor(
            [float(i), random.random(), float(np.random.rand()), float(torch.rand(()))], dtype=torch.float64
        )


class PidDataset(RangeDataset):
    """Sample i is (i, pid of the worker that loaded it); optional per-item delay."""

    def __init__(self, n: int, delay: float = 0.0, slow_pids: dict | None = None):
        super().__init__(n)
        self.delay = delay
        self.slow = slow_pids or {}

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay * self.slow.get(os.getpid(), 1))
        return torch.tensor([i, os.getpid()])


class PoisonDataset(RangeDataset):
    """Loading sample `poison` kills the worker process (like a segfaulting decoder)."""

    def __init__(self, n: int, poison: int, delay: float = 0.0):
        super().__init__(n)
        self.poison = poison
        self.delay = delay

    def __getitem__(self, i):
        if i == self.poison:
            os._exit(17)
        if self.delay:
            time.sleep(self.delay)
        return super().__getitem__(i)


def print_lots(nbytes: int) -> int:
    """Print ``nbytes`` on stdout (and a little on stderr), as a chatty dataset does; return
    ``nbytes``. A worker whose parent stops reading its stdout blocks here past 64 KiB."""
    import sys

    for _ in range(0, nbytes, 1000):
        print("x" * 999, flush=True)
    print("a line on stderr", file=sys.stderr, flush=True)
    return nbytes


def secret_seen_by_worker_code() -> dict:
    """What code running on a worker finds of TORCHFEED_SECRET: in its os.environ, in the
    environment of a subprocess it starts, and in the environment its process started with."""
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.environ.get('TORCHFEED_SECRET', ''))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    with open("/proc/self/environ", "rb") as f:
        block = f.read()
    try:
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            forked = f.read() == block  # a forked worker shows its parent's initial environment
    except OSError:
        forked = False
    initial = [entry.split(b"=", 1)[0] for entry in block.split(b"\0")]
    return {
        "os.environ": os.environ.get("TORCHFEED_SECRET"),
        "subprocess": child.stdout.strip(),
        # started with it (a forked worker was not started: what its parent started with is the parent's)
        "started with it": b"TORCHFEED_SECRET" in initial and not forked,
        "pid": os.getpid(),
    }


class OffsetDataset(SizedDataset):
    """Sample i is ``offset + i``; a worker_init_fn may set ``offset`` on a worker's copy."""

    def __init__(self, n):
        super().__init__(n)
        self.offset = 0

    def __getitem__(self, i):
        return self.offset + i


class WorkerShare(torch.utils.data.IterableDataset):
    """Iterable-style: 0..n-1 split by worker id, as torch's documentation shows."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k, m = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(k, self.n, m))
