"""Errors: remote exceptions keep their type; reaching, authenticating and pickling fail clearly."""

from __future__ import annotations

import pickle
import secrets
import sys
import threading
import time

import pytest

import torchfeed
from compat_datasets import Batched, CorruptSample, Failing, Plain, StopsAt, Typed
from helpers import RangeDataset, SleepDataset
from torchfeed.util import free_port

pytestmark = pytest.mark.timeout(120)

SECRET_A = secrets.token_hex(32)
SECRET_B = secrets.token_hex(32)


def test_getitem_exception_is_its_type_and_remote_error(workers2):
    ds = torchfeed.RemoteDataset(workers2, Typed, 10, {6: "custom", 2: "file"})
    it = iter(torchfeed.RemoteDataLoader(ds, batch_size=4))
    with pytest.raises(FileNotFoundError) as info:
        next(it)
    err = info.value
    assert isinstance(err, torchfeed.RemoteError) and isinstance(err, OSError)
    assert (err.errno, err.filename) == (2, "/data/2.jpg")  # the original's fields
    assert err.indices == [0, 1, 2, 3] and err.address in workers2 and err.remote_type == "FileNotFoundError"
    # the worker's traceback ends in the user's __getitem__, naming its file and the raise
    assert "compat_datasets.py" in err.remote_traceback and "in __getitem__" in err.remote_traceback
    assert err.remote_traceback.rstrip().endswith(
        "FileNotFoundError: [Errno 2] No such file or directory: '/data/2.jpg'"
    )
    # a type of the user's, imported here and built from its arguments: its type, by default
    with pytest.raises(CorruptSample) as corrupt:
        next(it)
    assert isinstance(corrupt.value, torchfeed.RemoteError)
    assert corrupt.value.remote_type == "compat_datasets.CorruptSample"
    assert (corrupt.value.index, corrupt.value.reason) == (6, "truncated JPEG")
    assert "sample 6: truncated JPEG" in str(corrupt.value)


def test_constructor_exception_is_its_type(workers2):
    with pytest.raises(PermissionError) as info:
        torchfeed.RemoteDataset(workers2, Failing)
    assert isinstance(info.value, torchfeed.RemoteError)
    assert info.value.filename == "/data/train"


def test_getitems_and_collate_exceptions(workers2):
    ds = torchfeed.RemoteDataset(workers2, Batched, 12, 5)
    with pytest.raises(LookupError):
        list(torchfeed.RemoteDataLoader(ds, batch_size=4))

    def collate(batch):
        raise NotImplementedError("no collate for this")

    with pytest.raises(NotImplementedError, match="no collate for this"):
        list(
            torchfeed.RemoteDataLoader(
                torchfeed.RemoteDataset(workers2, Plain), batch_size=4, collate_fn=collate
            )
        )


def test_rpc_exceptions_keep_local_classes(workers2):
    class LocalError(ValueError):  # defined here: travels by value, comes back as this very class
        pass

    def boom():
        raise LocalError("from a local class")

    # not allowed: its nearest allowed base (a ValueError), and a RemoteError
    with pytest.raises(ValueError) as info:
        torchfeed.rpc_async(workers2[0], boom).wait()
    assert isinstance(info.value, torchfeed.RemoteError) and not isinstance(info.value, LocalError)
    assert info.value.remote_type.endswith("test_rpc_exceptions_keep_local_classes.<locals>.LocalError")
    # allowed for the call: this very class
    with pytest.raises(LocalError) as info:
        torchfeed.rpc_async(workers2[0], boom, safe_globals=[LocalError]).wait()
    assert isinstance(info.value, torchfeed.RemoteError)
    with pytest.raises(KeyError):
        torchfeed.rpc_async(workers2[0], lambda: {"present": 0}["missing"]).wait()
    # handed to another process (pickled), it is still both types, with its fields
    rebuilt = pickle.loads(pickle.dumps(_error_of(workers2[0], lambda: 1 / 0)))
    assert isinstance(rebuilt, ZeroDivisionError) and isinstance(rebuilt, torchfeed.RemoteError)
    assert rebuilt.address == workers2[0] and "1 / 0" in rebuilt.remote_traceback


def _error_of(address, fn):
    try:
        torchfeed.rpc_async(address, fn).wait()
    except Exception as exc:  # noqa: BLE001
        return exc
    raise AssertionError("no error")


@pytest.mark.slow
def test_types_unknown_here_fall_back_to_remote_error(fresh_workers, tmp_path):
    (tmp_path / "only_on_worker.py").write_text(
        "class Boom(Exception):\n    pass\n\nclass Thing:\n    pass\n"
    )
    w = fresh_workers(1, env={"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}"})
    address = w.addresses[0]

    def raise_boom():
        import only_on_worker  # type: ignore[import-not-found]  # written by this test, for the worker

        raise only_on_worker.Boom("not importable in the trainer")

    err = _error_of(address, raise_boom)
    assert type(err) is torchfeed.RemoteError and err.remote_type == "only_on_worker.Boom"

    def make_thing():
        import only_on_worker

        return only_on_worker.Thing()

    with pytest.raises(
        torchfeed.UnsafeReplyError, match=f"worker {address}: the reply needs only_on_worker.Thing"
    ):
        torchfeed.rpc_async(address, make_thing).wait()
    with pytest.raises(
        torchfeed.SerializationError, match=f"reply from worker {address} could not be unpickled"
    ):
        torchfeed.rpc_async(address, make_thing, trust_worker=True).wait()


def test_stop_iteration_does_not_end_the_epoch_silently(workers2):
    ds = torchfeed.RemoteDataset(workers2, StopsAt, 3)
    with pytest.raises(torchfeed.RemoteError, match="StopIteration") as info:
        list(torchfeed.RemoteDataLoader(ds, batch_size=2))
    assert not isinstance(info.value, StopIteration)  # raised from __next__ it would end the loop quietly


def test_timeout_is_a_runtime_error(workers2):
    ds = torchfeed.RemoteDataset(workers2, SleepDataset, 8, 2.0)
    with pytest.raises(RuntimeError) as info:
        next(iter(torchfeed.RemoteDataLoader(ds, batch_size=2, timeout=0.3)))
    assert isinstance(info.value, torchfeed.Timeout) and isinstance(info.value, TimeoutError)


@pytest.mark.slow
def test_wrong_secret_is_an_authentication_error(fresh_workers):
    w = fresh_workers(1, env={"TORCHFEED_SECRET": SECRET_A})
    with pytest.raises(torchfeed.AuthenticationError, match="rejected this client's secret"):
        torchfeed.RemoteDataset(w.addresses, RangeDataset, 4)
    with pytest.raises(torchfeed.AuthenticationError):
        torchfeed.RemoteDataLoader(workers=w.addresses, dataset=RangeDataset, args=(4,))


def test_unpicklable_argument_is_named(workers2):
    lock = threading.Lock()
    with pytest.raises(torchfeed.SerializationError) as info:
        torchfeed.RemoteDataset(workers2, SleepDataset, 4, 0.0, slow_pid_factor=lock)
    message = str(info.value)
    assert "argument 'slow_pid_factor' of SleepDataset (lock object)" in message
    assert "Construct it inside the dataset on the worker" in message
    assert isinstance(info.value, TypeError) and isinstance(info.value, pickle.PicklingError)
    with pytest.raises(torchfeed.SerializationError, match="argument 'n' of RangeDataset"):
        torchfeed.RemoteDataset(workers2, RangeDataset, (x for x in range(3)))


def test_dataset_instance_instead_of_class_says_what_to_do(workers2):
    with pytest.raises(TypeError, match=r"pass the class .* RemoteDataset\(workers, RangeDataset, arg1"):
        torchfeed.RemoteDataset(workers2, RangeDataset(4))  # type: ignore[arg-type]  # an instance: refused
    with pytest.raises(TypeError, match=r"RemoteDataLoader\(RemoteDataset\(workers, RangeDataset, \*args\)"):
        torchfeed.RemoteDataLoader(RangeDataset(4), batch_size=2)
    with pytest.raises(TypeError, match="got the class RangeDataset"):
        torchfeed.RemoteDataLoader(RangeDataset, batch_size=2)


@pytest.mark.slow
def test_module_not_found_on_a_worker_says_how_to_fix_it(fresh_workers, tmp_path, monkeypatch):
    (tmp_path / "trainer_only.py").write_text(
        "import torch\n\nclass Local(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n        return 4\n\n    def __getitem__(self, i):\n        return i\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # importable here only
    from trainer_only import Local  # type: ignore[import-not-found]  # written by this test

    # a worker that does not get our sys.path (a forked one would have our modules already)
    blind = fresh_workers(1, env={"TORCHFEED_SYS_PATH": ""}, start="spawn")
    with pytest.raises(ModuleNotFoundError) as info:
        torchfeed.RemoteDataset(blind.addresses, Local)
    message = str(info.value)
    assert "module 'trainer_only' cannot be imported on worker" in message
    assert "PYTHONPATH" in message and "pip install -e ." in message
    # LocalWorkers give their workers this process's sys.path: the same module just works
    seeing = fresh_workers(1)
    assert [
        b.tolist()
        for b in torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(seeing.addresses, Local), batch_size=2)
    ] == [[0, 1], [2, 3]]


@pytest.mark.slow
def test_late_worker_is_waited_for(fresh_workers, tmp_path):
    """A worker that starts after the trainer (the Slurm / torchrun case): refused connections
    are retried until it answers."""
    port = free_port()  # nothing listens there now
    started: list = []
    thread = threading.Thread(target=_start_worker_on, args=(port, started), daemon=True)
    thread.start()
    try:
        ds = torchfeed.RemoteDataset([f"127.0.0.1:{port}"], RangeDataset, 6)
        assert len(list(torchfeed.RemoteDataLoader(ds, batch_size=2))) == 3
    finally:
        thread.join(60)
        for proc in started:
            proc.terminate()
            proc.wait(10)


def _start_worker_on(port, started):
    import subprocess

    time.sleep(1.5)
    started.append(
        subprocess.Popen(
            [sys.executable, "-m", "torchfeed", "worker", "--host", "127.0.0.1", "--port", str(port)],
            stdout=subprocess.DEVNULL,
        )
    )
