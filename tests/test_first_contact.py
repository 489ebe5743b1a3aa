"""What a new user meets first: worker output, warnings at the right line, quiet exits."""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

import torchfeed
from helpers import RangeDataset, SleepDataset, wait_for
from torchfeed.util import free_port, pid_alive

pytestmark = pytest.mark.timeout(120)


class Chatty(torch.utils.data.Dataset):
    """Prints a megabyte to stdout and a line to stderr for every sample."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        print("x" * (1 << 20))
        print(f"sample {i} loaded", file=sys.stderr)
        return i


@pytest.mark.slow
def test_a_dataset_that_prints_a_lot_completes_and_its_output_arrives_prefixed(capsys):
    with torchfeed.LocalWorkers(1) as workers:
        ds = torchfeed.RemoteDataset(workers.addresses, Chatty)
        assert torch.cat(list(torchfeed.RemoteDataLoader(ds, batch_size=2))).tolist() == list(range(6))
        prefix = f"[worker 0 {workers.addresses[0]}] "
    out, err = capsys.readouterr()
    big = [line for line in out.splitlines() if line.endswith("x" * 100)]
    assert len(big) == 6 and all(line == prefix + "x" * (1 << 20) for line in big)
    assert sorted(line for line in err.splitlines() if "loaded" in line) == [
        f"{prefix}sample {i} loaded" for i in range(6)
    ]


@pytest.mark.slow
def test_lost_worker_is_logged_not_warned(fresh_workers, caplog):
    w = fresh_workers(2)
    ds = torchfeed.RemoteDataset(w.addresses, SleepDataset, 40, 0.02)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2, straggler_factor=None)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, "torchfeed"):
        warnings.simplefilter("always")
        for i, _ in enumerate(loader):
            if i == 2:
                w.kill(0)
    assert not [c for c in caught if "lost worker" in str(c.message)]
    lost = [r for r in caplog.records if "lost worker" in r.getMessage()]
    assert len(lost) == 1 and lost[0].name == "torchfeed.workers" and lost[0].levelno == logging.WARNING
    assert loader.stats().workers[w.addresses[0]].state in ("lost", "reconnecting")


@pytest.mark.slow
def test_no_worker_left_is_said_at_once_with_the_wait(fresh_workers, caplog):
    w = fresh_workers(1)
    ds = torchfeed.RemoteDataset(w.addresses, SleepDataset, 40, 0.02)
    it = iter(torchfeed.RemoteDataLoader(ds, batch_size=2, timeout=3))
    next(it)
    w.kill(0)
    with caplog.at_level(logging.INFO, "torchfeed"):
        start = time.monotonic()
        with pytest.raises(torchfeed.WorkerLost, match="no worker is left"):
            while True:
                next(it)
        said = [r.getMessage() for r in caplog.records if "no worker is left" in r.getMessage()]
        assert len(said) == 1 and "waiting up to 3 s" in said[0]
        assert time.monotonic() - start >= 2.5  # it did wait for a worker to come back


QUIET_EXIT = """
import os, signal, sys, threading, time
sys.path.insert(0, {tests!r})
import torchfeed
from helpers import SleepDataset
workers = torchfeed.LocalWorkers(2)
ds = torchfeed.RemoteDataset(workers.addresses, SleepDataset, 200, 0.05)
it = iter(torchfeed.RemoteDataLoader(ds, batch_size=2))
next(it)
if {interrupt!r}:
    # what Ctrl-C in a terminal does: SIGINT to the whole foreground process group
    threading.Timer(0.5, lambda: os.killpg(os.getpgid(0), signal.SIGINT)).start()
    with workers:
        for batch in it:
            pass
print("done", flush=True)   # at exit: the pass is open, requests are in flight
"""


@pytest.mark.slow
@pytest.mark.parametrize("interrupt", [False, True])
def test_no_lost_worker_warnings_at_exit_or_after_ctrl_c(tmp_path, interrupt):
    script = tmp_path / "train.py"
    script.write_text(QUIET_EXIT.format(tests=os.path.dirname(__file__), interrupt=interrupt))
    proc = subprocess.run(
        [sys.executable, "-W", "always", str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        start_new_session=True,
    )
    assert "lost worker" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    if interrupt:
        assert proc.returncode != 0 and proc.stderr.rstrip().endswith("KeyboardInterrupt"), proc.stderr
    else:
        assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr


@pytest.mark.slow
def test_workers_stop_with_a_killed_trainer(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys, time, torchfeed\nw = torchfeed.LocalWorkers(2)\n"
        "print(' '.join(str(p.pid) for p in w.processes), flush=True)\ntime.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        proc.kill()
        proc.wait()

    assert wait_for(lambda: not any(pid_alive(p) for p in pids), 30), (
        "worker processes outlived their trainer"
    )


# -- calling a worker that is still starting ------------------------------------------------
def _start_worker(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torchfeed", "worker", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        env=os.environ.copy(),  # PYTHONPATH and TORCHFEED_SECRET, as conftest set them
    )


@pytest.mark.slow
@pytest.mark.parametrize("own_session", [False, True])
def test_rpc_async_waits_for_a_worker_that_is_still_starting(own_session):
    port = free_port()
    proc = _start_worker(port)  # importing torch takes it a second or more: nothing listens yet
    try:
        address = f"127.0.0.1:{port}"
        if own_session:
            with torchfeed.Session(timeout=60) as session:
                assert session.rpc_async(address, os.getpid).wait() == proc.pid
        else:
            assert torchfeed.rpc_async(address, os.getpid, timeout=60).wait() == proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def test_waiting_for_a_starting_worker_blocks_no_caller(workers2):
    """rpc_async returns at once while a thread of the session waits for the worker; a call
    chained on another worker's reply (a reader thread) must not stall that reader, or the
    healthy worker would be declared lost for its silence."""
    dead = f"127.0.0.1:{free_port()}"
    with torchfeed.Session(heartbeat_interval=0.2, heartbeat_timeout=1.0, timeout=3.0) as s:
        live = workers2[0]
        s.rpc_async(live, os.getpid).wait()
        waiting = s.rpc_async(dead, os.getpid)
        assert not waiting.done()  # returned before the first retry
        chained = s.rpc_async(live, time.sleep, args=(0.05,)).then(lambda _f: s.rpc_async(dead, os.getpid))
        assert s.rpc_async(live, time.sleep, args=(1.5,)).wait() is None  # not lost meanwhile
        with pytest.raises(torchfeed.WorkerLost, match="refused"):
            waiting.wait()
        with pytest.raises(torchfeed.WorkerLost, match="refused"):
            chained.wait().wait()


def test_adding_an_unreachable_worker_does_not_wait(workers2):
    """add_workers builds at once where it can and leaves a refusing worker to the background
    retries, as before: it does not wait for the timeout, one address after another."""
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    with torchfeed.Session(timeout=60) as s:
        ds = torchfeed.RemoteDataset(workers2[:1], RangeDataset, 5, session=s)
        done = []
        thread = threading.Thread(target=lambda: done.append(ds.add_workers(dead)), daemon=True)
        thread.start()
        thread.join(20)  # far below the 2 x 60 s it took while every new address waited
        assert done == [[]]
        assert sorted(ds.lost_workers()) == sorted(dead)
        ds.close()


# -- samples torch's DataLoader takes as they are -----------------------------------------------
class GradSamples(torch.utils.data.Dataset):
    """Samples that require grad (a learned augmentation's output, say)."""

    def __len__(self):
        return 5

    def __getitem__(self, i):
        return torch.full((3,), float(i), requires_grad=True), i


def test_samples_that_require_grad_collate_as_in_torch(workers2):
    ds = torchfeed.RemoteDataset(workers2, GradSamples)
    ours = list(torchfeed.RemoteDataLoader(ds, batch_size=2))
    theirs = list(torch.utils.data.DataLoader(GradSamples(), batch_size=2))
    assert len(ours) == len(theirs) == 3
    for (x, y), (tx, ty) in zip(ours, theirs):
        assert torch.equal(x.detach(), tx.detach()) and torch.equal(y, ty)
        assert x.requires_grad == tx.requires_grad and y.requires_grad == ty.requires_grad


class Layouts(torch.utils.data.Dataset):
    """Tensors whose strides are not the contiguous ones."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return [
            torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
            torch.randn(4, 6, generator=g).t(),
            torch.randn(3, generator=g).expand(4, 3),
            torch.randn(5, 8, generator=g)[:, ::2],  # gaps: at most as many bytes as the elements
        ][i]


def test_unbatched_tensors_keep_their_strides_as_in_torch(workers2):
    ds = torchfeed.RemoteDataset(workers2, Layouts)
    ours = list(torchfeed.RemoteDataLoader(ds, batch_size=None))
    theirs = list(torch.utils.data.DataLoader(Layouts(), batch_size=None))
    assert [t.stride() for t in ours] == [t.stride() for t in theirs]
    assert [t.shape for t in ours] == [t.shape for t in theirs]
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert ours[0].is_contiguous(memory_format=torch.channels_last)


class Sparse(torch.utils.data.Dataset):
    """A few columns of a wide tensor: its storage is far larger than its elements."""

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return torch.arange(4000.0).view(4, 1000)[:, :3]


def test_a_slice_of_a_much_larger_tensor_travels_compact_in_its_dimension_order(workers2):
    """torch's worker processes share the whole storage; across a network only the elements
    travel when the storage around them is more than twice their size (documented)."""
    (ours,) = list(torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(workers2, Sparse), batch_size=None))
    assert torch.equal(ours, Sparse()[0]) and ours.stride() == (3, 1)
    assert ours.untyped_storage().nbytes() == 4 * 3 * 4


# -- errors that read like torch's ----------------------------------------------------------------
@pytest.mark.parametrize("style", ["map", pytest.param("iterable", marks=pytest.mark.slow)])
def test_loader_timeout_reads_like_torch(workers2, style):
    from stream_datasets import Counting

    if style == "map":
        ds = torchfeed.RemoteDataset(workers2, SleepDataset, 4, 1.0)
    else:
        ds = torchfeed.RemoteDataset(workers2, Counting, 4, 1.0)
    with pytest.raises(RuntimeError) as info:
        next(iter(torchfeed.RemoteDataLoader(ds, batch_size=1, timeout=0.5)))
    assert isinstance(info.value, torchfeed.Timeout)
    # torch: RuntimeError(f"DataLoader timed out after {timeout} seconds"); then what torchfeed knows
    message = str(info.value)
    assert message.startswith("DataLoader timed out after 0.5 seconds: "), message
    assert workers2[0] in message or workers2[1] in message, message


# -- a worker that does not answer, and RemoteDataset's own keywords -------------------------------
def test_a_refusing_worker_is_said_at_once_and_again_while_waiting(monkeypatch, caplog):
    from torchfeed.client import reach

    monkeypatch.setattr(reach, "REFUSED_LOG_EVERY", 0.3)
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, "torchfeed"), pytest.raises(torchfeed.WorkerLost, match="refused"):
        torchfeed.RemoteDataset([address], RangeDataset, 5, timeout=1.5)
    said = [r for r in caplog.records if address in r.getMessage()]
    assert said and all(r.name == "torchfeed.workers" and r.levelno == logging.WARNING for r in said)
    assert "refuses connections" in said[0].getMessage() and "for up to 1.5 s" in said[0].getMessage()
    again = [r.getMessage() for r in said[1:]]
    assert len(again) >= 2 and all("still refuses connections after" in m for m in again), again


class TakesTimeout(RangeDataset):
    """A dataset with a ``timeout`` parameter of its own."""

    def __init__(self, n: int, timeout: float = 1.0):
        super().__init__(n)
        self.timeout = timeout


def test_remote_dataset_timeout_is_its_own(workers2):
    ds = torchfeed.RemoteDataset(workers2, RangeDataset, 5, timeout=7)  # RangeDataset takes no timeout
    assert ds.timeout == 7 and len(ds) == 5


def test_timeout_for_a_factory_that_takes_one_is_refused_with_both_ways(workers2):
    with pytest.raises(TypeError) as info:
        torchfeed.RemoteDataset(workers2, TakesTimeout, 5, timeout=3)
    message = str(info.value)
    assert "ambiguous" in message and "functools.partial(TakesTimeout, timeout=3)" in message
    assert "session=torchfeed.Session(timeout=3)" in message
    # each way said there works
    ds = torchfeed.RemoteDataset(workers2, functools.partial(TakesTimeout, timeout=3), 5)
    assert ds.run_on_workers(lambda d: d.timeout, pass_dataset=True) == {w: 3 for w in workers2}
    with torchfeed.Session(timeout=9) as session:
        assert torchfeed.RemoteDataset(workers2, TakesTimeout, 5, session=session).timeout == 9


class TakesAnyKeyword(torch.utils.data.Dataset):
    def __init__(self, n, **options):
        self.n, self.options = n, options

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def test_timeout_is_ambiguous_for_a_factory_taking_any_keyword_but_not_once_bound(workers2):
    """**kwargs could take timeout= (it did before it became RemoteDataset's own): refused, not
    swallowed; a partial that binds the factory's timeout leaves timeout= to RemoteDataset."""
    with pytest.raises(TypeError, match=r"ambiguous.*\*\*kwargs"):
        torchfeed.RemoteDataset(workers2, TakesAnyKeyword, 5, timeout=3)
    ds = torchfeed.RemoteDataset(workers2, functools.partial(TakesTimeout, timeout=3), 5, timeout=7)
    assert ds.timeout == 7
    assert ds.run_on_workers(lambda d: d.timeout, pass_dataset=True) == {w: 3 for w in workers2}


def test_loader_kwargs_are_the_factory_s_timeout_included(workers2):
    loader = torchfeed.RemoteDataLoader(
        workers=workers2, dataset=TakesTimeout, args=(4,), kwargs={"timeout": 3}
    )
    assert isinstance(loader.dataset, torchfeed.RemoteDataset)
    assert loader.dataset.run_on_workers(lambda d: d.timeout, pass_dataset=True) == {w: 3 for w in workers2}
    assert len(list(loader)) == 4


class Lines(torch.utils.data.Dataset):
    """The lines of a text file (given as an open file object: the mistake under test)."""

    def __init__(self, source):
        self.lines = list(source)

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, i):
        return self.lines[i]


@pytest.mark.parametrize("mode", ["r", "rb"])
@pytest.mark.parametrize("nested", [False, True])
def test_an_open_file_argument_is_refused_with_what_to_do(workers2, tmp_path, mode, nested):
    path = tmp_path / "lines.txt"
    path.write_text("a\nb\n")
    with open(path, mode) as f:
        with pytest.raises(torchfeed.SerializationError) as info:
            torchfeed.RemoteDataset(workers2, Lines, [f] if nested else f)
    message = str(info.value)
    assert "open file" in message and str(path) in message, message
    assert "pass its path" in message and "open it in the dataset" in message, message


def test_an_open_file_is_not_sent_by_rpc_either(workers2, tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("a\nb\n")
    with open(path) as f, pytest.raises(torchfeed.SerializationError, match="pass its path"):
        torchfeed.rpc_async(workers2[0], len, args=(f,)).wait()


@pytest.mark.parametrize("address", ["127.0.0.1:6543:1", "::1:6543", "host:0", "host:70000", "host:"])
def test_a_malformed_address_is_refused_with_the_form_expected(address):
    with pytest.raises(ValueError, match="host:port"):
        torchfeed.client.parse_address(address)


def test_an_unresolvable_host_says_so_not_that_the_timeout_ran_out():
    session = torchfeed.Session(timeout=60)
    try:
        fut = session.rpc_async("no-such-host.invalid:6543", len, args=(b"",), wait_for_worker=False)
        with pytest.raises(torchfeed.WorkerLost, match="does not resolve") as caught:
            fut.wait()
        assert "within 60" not in str(caught.value)
    finally:
        session.close()
