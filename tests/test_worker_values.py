"""What a worker sends that the trainer acts on, beyond loading it safely.

A worker's replies load without running code (tests/test_safe_replies.py); here, their
*values*: an error's attributes must not shadow RemoteError's methods, a worker's torchfeed
errors must not steer the trainer (a lost worker, a timeout), the numbers it reports are
checked before anything is sized by them, and ``torchfeed top`` prints none of its
strings raw. Every test guards against a hang with an explicit timeout.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch

import torchfeed
from helpers import PROMPT
from torchfeed import errors
from torchfeed.datasets import Shards
from torchfeed.protocol import errordata, replies

pytestmark = pytest.mark.timeout(120)


# -- an error's attributes cannot shadow RemoteError's ---------------------------------


class ShadowingDataset(torch.utils.data.Dataset):
    """Ordinary code: an error with an attribute named like one of RemoteError's methods."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 3:
            e = ValueError("x")
            vars(e)["with_indices"] = None  # an attribute ValueError does not have
            raise e
        return i


def test_error_state_cannot_shadow_methods_or_fields():
    try:
        raise ValueError("v")
    except ValueError as exc:
        info = errordata.describe_exception(exc)
    info["state"] = {
        "with_indices": None,
        "_render": 1,
        "add_note": 2,
        "address": "elsewhere",
        "remote_traceback": 3,
        "remote_class": "str",
        "indices": [99],
        "__dict__": {"with_indices": None},
        "code": 7,  # an ordinary attribute: kept
    }
    err = errordata.rebuild_remote_error("w:1", info, indices=[1, 2])
    assert isinstance(err, ValueError) and isinstance(err, torchfeed.RemoteError)
    assert err.with_indices([4, 5]) is err and err.indices == [4, 5]
    assert err.address == "w:1" and err.remote_class is ValueError and isinstance(err.remote_traceback, str)
    assert "ValueError: v" in str(err) and vars(err)["code"] == 7

    class Coded(Exception):
        code = 0  # a plain class default may be overridden; a method may not

        def method(self):
            return "mine"

    made = errors.remote_type_for(Coded)
    assert made is not None
    coded = errors.instantiate(made, Coded, ("m",), {"code": 5, "method": None})
    assert isinstance(coded, Coded) and coded.code == 5 and coded.method() == "mine"


def test_dataset_error_with_a_shadowing_attribute_is_raised(workers2):
    loader = torchfeed.RemoteDataLoader(
        torchfeed.RemoteDataset(workers2, ShadowingDataset), batch_size=2, timeout=PROMPT
    )
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        list(loader)
    assert time.monotonic() - start < PROMPT
    assert isinstance(info.value, torchfeed.RemoteError) and info.value.indices == [2, 3]


def test_a_result_that_cannot_be_recorded_fails_its_batch(workers2, monkeypatch):
    # a fault in the trainer's own bookkeeping of a result (here injected) fails that batch
    # in its turn instead of leaving it unsettled for ever
    def broken(self, indices):
        raise RuntimeError("injected")

    monkeypatch.setattr(torchfeed.RemoteError, "with_indices", broken)
    loader = torchfeed.RemoteDataLoader(
        torchfeed.RemoteDataset(workers2, ShadowingDataset), batch_size=2, timeout=PROMPT
    )
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    with pytest.raises(ValueError) as info:
        next(it)
    assert isinstance(info.value, torchfeed.RemoteError) and info.value.remote_message == "x"


# -- a worker's torchfeed errors do not steer the trainer --------------------------------


def _described(exc: BaseException) -> dict:
    try:
        raise exc
    except BaseException as raised:
        return errordata.describe_exception(raised)


class MyLost(torchfeed.WorkerLost):
    """A user's subclass of a control error: allowed, it still is not rebuilt as one."""


@pytest.mark.parametrize(
    "remote, also",
    [
        (torchfeed.WorkerLost("inner", {"a:1": "x"}), None),
        (errors.ConnectionClosed("closed"), None),
        (torchfeed.Timeout("slow"), TimeoutError),
        (torchfeed.ProtocolError("bad"), None),
        (torchfeed.AuthenticationError("who"), None),
        (torchfeed.SerializationError("pickle"), (TypeError, pickle.PicklingError)),  # (trusted: the latter)
        (torchfeed.UnsafeReplyError("global"), (TypeError, pickle.PicklingError)),
        (torchfeed.PoisonSampleError("poison", [1], ["a:1"]), None),
        (MyLost("mine"), None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_remote_torchfeed_errors_are_not_rebuilt_as_themselves(remote, also):
    info = _described(remote)
    for policy in (replies.SAFE, replies.policy([MyLost]), replies.TRUSTED):
        err = errordata.rebuild_remote_error("w:1", info, policy=policy)
        assert isinstance(err, torchfeed.RemoteError)
        assert err.remote_type == f"{type(remote).__module__}.{type(remote).__qualname__}"
        for control in (
            torchfeed.WorkerLost,
            torchfeed.Timeout,
            torchfeed.ProtocolError,
            torchfeed.AuthenticationError,
            torchfeed.SerializationError,
            torchfeed.PoisonSampleError,
        ):
            assert not isinstance(err, control), (type(err).__mro__, control)
        if also is None:
            assert type(err) is torchfeed.RemoteError
        else:
            assert isinstance(err, also)


@pytest.mark.parametrize("report", [errors.FrameTooLarge, errors.LimitExceeded])
def test_a_workers_reports_of_a_request_over_a_limit_are_rebuilt_as_such(report):
    # the worker's torchfeed raises these about one request (a reply over the trainer's
    # limit, a per-client bound); the trainer only raises them to the user
    info = _described(report("over the limit"))
    info["state"] = {"frame": "not a frame"}  # torchfeed's own attributes are never a worker's
    err = errordata.rebuild_remote_error("w:1", info)
    assert isinstance(err, report) and isinstance(err, torchfeed.RemoteError)
    assert not isinstance(err, torchfeed.WorkerLost)
    if report is errors.FrameTooLarge:
        assert isinstance(err, errors.FrameTooLarge) and err.frame is None

    Mine = type("Mine", (report,), {})

    sub = errordata.rebuild_remote_error("w:1", _described(Mine("m")), policy=replies.policy([Mine]))
    assert type(sub) is errors.remote_type_for(report)  # these two exactly: a subclass is its base


def test_crafted_bases_naming_control_errors_are_not_rebuilt():
    info = _described(ValueError("v"))
    info["bases"] = ["evil.Lost", "torchfeed.errors.ConnectionClosed", "torchfeed.errors.WorkerLost"]
    assert type(errordata.rebuild_remote_error("w:1", info)) is torchfeed.RemoteError
    # a worker's RemoteError (from a call its dataset made) is rebuilt as the type it carries
    nested = errordata.rebuild_remote_error("inner:1", _described(KeyError("k")))
    err = errordata.rebuild_remote_error("w:1", _described(nested))
    assert isinstance(err, KeyError) and isinstance(err, torchfeed.RemoteError) and err.address == "w:1"


class RaisesWorkerLost(torch.utils.data.Dataset):
    """Dataset code that lets a torchfeed error of its own (nested) call propagate."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            raise torchfeed.WorkerLost("a worker this dataset itself called was lost")
        return i


def _raise_worker_lost():
    raise torchfeed.WorkerLost("inner")


def test_worker_lost_raised_by_dataset_code_is_an_error_not_a_lost_worker(workers2):
    with pytest.raises(torchfeed.RemoteError) as info:
        torchfeed.rpc_async(workers2[0], _raise_worker_lost).wait()
    assert not isinstance(info.value, torchfeed.WorkerLost)
    ds = torchfeed.RemoteDataset(workers2, RaisesWorkerLost)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2, timeout=PROMPT)
    start = time.monotonic()
    it = iter(loader)
    assert [next(it).tolist(), next(it).tolist()] == [[0, 1], [2, 3]]
    with pytest.raises(torchfeed.RemoteError) as info:
        next(it)
    assert time.monotonic() - start < PROMPT
    err = info.value
    assert not isinstance(err, torchfeed.WorkerLost) and err.remote_type == "torchfeed.errors.WorkerLost"
    assert err.indices == [4, 5] and "this dataset itself called" in str(err)
    assert ds.lost_workers() == {} and sorted(ds.alive_workers()) == sorted(workers2)


# -- iterable-style passes: a stream's malformed reply or its dataset's OSError -----------


class _Garbage(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def _answer_streams_with_garbage() -> None:
    """On a worker: every stream request is answered with something that is not a stream's reply."""
    import torchfeed.worker.streams as streams

    streams.Stream.__call__ = lambda self, grants=(), total=None: ("not", "a", "reply")  # type: ignore[method-assign]  # sabotaged on purpose


def test_a_malformed_stream_reply_ends_the_pass_with_an_error(fresh_workers):
    address = fresh_workers(1).addresses[0]
    torchfeed.rpc_async(address, _answer_streams_with_garbage).wait()
    loader = torchfeed.RemoteDataLoader(torchfeed.RemoteDataset([address], _Garbage), timeout=PROMPT)
    with pytest.raises(torchfeed.ProtocolError, match=f"worker {address} .* not a stream's reply"):
        list(loader)


class MissingFile(torch.utils.data.IterableDataset):
    """Opening the stream fails with an OSError of the dataset's own (not a lost connection)."""

    def __iter__(self):
        return iter(open("/nonexistent/torchfeed-test-file"))


def test_a_dataset_oserror_opening_a_stream_is_raised_not_a_lost_worker(workers2):
    ds = torchfeed.RemoteDataset(workers2, MissingFile)
    with pytest.raises(FileNotFoundError) as info:
        list(torchfeed.RemoteDataLoader(ds, timeout=PROMPT))
    assert isinstance(info.value, torchfeed.RemoteError) and not isinstance(info.value, torchfeed.WorkerLost)
    assert ds.lost_workers() == {} and sorted(ds.alive_workers()) == sorted(workers2)


# -- numbers a worker reports are checked before anything is sized by them ---------------


class PlannedShards(Shards):
    """Shards whose plan (number of shards, shuffle, seed) is given: what a worker reports."""

    def __init__(self, plan):
        super().__init__(["s0", "s1"], str.split)
        self.plan = plan

    def _torchfeed_plan(self):
        return self.plan


@pytest.mark.parametrize(
    "plan, match",
    [
        ((10**10, False, None), "10000000000 shards"),
        ((-1, False, None), "-1 shards"),
        (("2", False, None), "a str shards"),
        ((True, False, None), "True shards"),
        ((2, "yes", None), "shuffle"),
        ((2, False, 1.5), "seed"),
        ([2, False, None], "not \\(number of shards"),
    ],
)
def test_shard_plans_out_of_range_are_refused(workers2, plan, match):
    ds = torchfeed.RemoteDataset(workers2, PlannedShards, plan)
    start = time.monotonic()
    with pytest.raises(torchfeed.TorchfeedError, match=f"worker {workers2[0]} .*{match}"):
        next(iter(torchfeed.RemoteDataLoader(ds, batch_size=None, timeout=PROMPT)))  # a pass starts at next()
    assert time.monotonic() - start < PROMPT


class HugeLength(torch.utils.data.Dataset):
    def __len__(self):
        return 2**62

    def __getitem__(self, i):
        return i


def _describe_as(value) -> None:
    """On a worker: describe every dataset with ``value``."""
    import torchfeed.client.building as building

    building.describe = lambda dataset: value


def test_dataset_lengths_out_of_range_are_refused(workers2, fresh_workers):
    with pytest.raises(
        torchfeed.TorchfeedError, match=f"worker {workers2[0]} reports a dataset length of {2**62}"
    ):
        torchfeed.RemoteDataset(workers2[:1], HugeLength)
    address = fresh_workers(1).addresses[0]
    for value, match in [
        ((False, -3), "length of -3"),
        ((False, 2.5), "length of a float"),
        ((False, True), "length of True"),
        ((False, 10**400), "length of an int of 1329 bits"),
        (("yes", 4), "not \\(is iterable, length\\)"),
        ((False, 4, 5), "not \\(is iterable, length\\)"),
    ]:
        torchfeed.rpc_async(address, _describe_as, args=(value,)).wait()
        with pytest.raises(torchfeed.TorchfeedError, match=f"worker {address} .*{match}"):
            torchfeed.RemoteDataset([address], ShadowingDataset)


# -- torchfeed top prints none of a worker's strings raw ---------------------------------

_PWNED = "\x1b]0;pwned\x07\x1b[2J\u202e"


def _send_stats_with_escapes(text: str) -> None:
    import json as json_
    import os as os_

    import torchfeed.worker.counters as stats

    fields = {"address": text, "pid": os_.getpid(), "clients": text, "queued": text, "errors": text}
    fields.update(
        cpu_percent=text, rss_bytes=1e6, extra=text, requests_per_s=float("nan"), mb_per_s_sent=10**400
    )
    stats.reply = lambda server: json_.dumps(fields).encode()


def test_top_prints_no_escape_sequence_a_worker_sent(fresh_workers):
    address = fresh_workers(1).addresses[0]
    torchfeed.rpc_async(address, _send_stats_with_escapes, args=(_PWNED,)).wait()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for args in ([], ["--json"]):
        out = subprocess.run(
            [sys.executable, "-m", "torchfeed", "top", "--once", *args, address],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        for bad in ("\x1b", "\x07", "\u202e", "pwned"):
            assert bad not in out.stdout, (bad, out.stdout)
    (row,) = json.loads(out.stdout)["workers"]
    assert row["address"] == address and row["pid"] > 0 and row["rss_mb"] == 1.0
    assert row["errors"] is None and row["cpu_percent"] is None and "extra" not in row
    # a row's error text (which may quote what a worker sent) is shown escaped
    from torchfeed.cli import top

    table = top.format_rows([{"address": address, "error": "RemoteError: " + _PWNED}])
    assert "\x1b" not in table and "\x07" not in table and "\\x1b]0;pwned\\x07" in table
