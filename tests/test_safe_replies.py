"""A worker's bytes run no code in the trainer: replies, errors and statistics, on every path.

A worker that holds the secret may be hostile (a compromised CPU node, or dataset code that
returns a crafted object). Each test here makes a worker send what plain pickle would run
(``os.system`` writing a marker file) and checks that nothing ran, that the refusal names the
global and says how to allow a type, and that the worker goes on serving. Where a test has a
trusted counterpart (``trust_worker=True``), that counterpart runs the payload: the marker
proves the attack is real.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

import torchfeed
from torchfeed.protocol import errordata, picklescan, rebuild, replies, serialize

pytestmark = pytest.mark.timeout(120)


class Evil:
    """Pickles as a call of ``os.system`` (``posix.system``) that creates ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


class Record:
    """A user's type with a rebuild hook of its own: refused until allowed."""

    def __init__(self, image: torch.Tensor, label: int):
        self.image, self.label = image, label

    def __reduce__(self):
        return Record, (self.image, self.label)


class HostileDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, bad: int, path: str):
        self.n, self.bad, self.path = n, bad, path

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return Evil(self.path) if i == self.bad else torch.full((2,), i)


class HostileStream(torch.utils.data.IterableDataset):
    def __init__(self, n: int, bad: int, path: str):
        self.n, self.bad, self.path = n, bad, path

    def __iter__(self):
        for i in range(self.n):
            yield Evil(self.path) if i == self.bad else torch.full((2,), i)


class Records(torch.utils.data.Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return Record(torch.full((3,), float(i)), i)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "ran"
    yield str(path)
    assert not path.exists()  # a check in every test's teardown too: nothing of a refused reply ran


@pytest.fixture
def allowlist():
    before = torchfeed.get_safe_globals()
    yield
    torchfeed.clear_safe_globals()
    torchfeed.add_safe_globals(before)


def _alive(address: str) -> None:
    assert torchfeed.rpc_async(address, sum, args=([1, 2],)).wait() == 3


def test_rpc_reply_runs_nothing_and_is_refused_by_name(workers2, marker):
    with pytest.raises(torchfeed.UnsafeReplyError) as info:
        torchfeed.rpc_async(workers2[0], Evil, args=(marker,)).wait()
    err = info.value
    assert err.global_name == "posix.system" and isinstance(err, torchfeed.SerializationError)
    message = str(err)
    assert workers2[0] in message and "posix.system" in message and "add_safe_globals" in message
    assert not os.path.exists(marker)
    _alive(workers2[0])


def test_trusting_a_worker_is_explicit_and_per_call(workers2, marker):
    # the same reply, trusted: plain pickle runs it (what every path above refuses)
    torchfeed.rpc_async(workers2[0], Evil, args=(marker,), trust_worker=True).wait()
    assert os.path.exists(marker)
    os.unlink(marker)
    with pytest.raises(torchfeed.UnsafeReplyError):  # the next call is restricted again
        torchfeed.rpc_async(workers2[0], Evil, args=(marker,)).wait()
    assert not os.path.exists(marker)


def test_map_style_batch_is_refused_in_its_place(workers2, marker):
    ds = torchfeed.RemoteDataset(workers2, HostileDataset, 12, 5, marker)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=2, collate_fn=list)
    it = iter(loader)
    assert [[t.tolist() for t in b] for b in (next(it), next(it))] == [[[0, 0], [1, 1]], [[2, 2], [3, 3]]]
    with pytest.raises(torchfeed.UnsafeReplyError, match="posix.system"):
        next(it)  # batch [4, 5]
    assert not os.path.exists(marker)
    # the workers keep serving: a loader without the hostile sample loads everything
    clean = torchfeed.RemoteDataLoader(
        torchfeed.RemoteDataset(workers2, HostileDataset, 12, -1, marker), batch_size=4
    )
    assert torch.cat([b[:, 0] for b in clean]).tolist() == list(range(12))


def test_iterable_batch_is_refused(workers2, marker):
    ds = torchfeed.RemoteDataset(workers2, HostileStream, 8, 3, marker)
    with pytest.raises(torchfeed.UnsafeReplyError, match="posix.system"):
        list(torchfeed.RemoteDataLoader(ds, batch_size=None))
    assert not os.path.exists(marker)
    _alive(workers2[1])


def _send_hostile_error_descriptions(path: str) -> None:
    """On a worker: from now on its error replies are pickles that call os.system."""
    import torchfeed.worker.serverconn as conn

    conn._describe_exception = lambda exc: pickle.dumps(Evil(path), protocol=5)


def _send_hostile_stats(path: str) -> None:
    import torchfeed.worker.counters as stats

    stats.reply = lambda server: pickle.dumps(Evil(path), protocol=5)


def test_error_reply_runs_nothing(fresh_workers, marker):
    address = fresh_workers(1).addresses[0]
    torchfeed.rpc_async(address, _send_hostile_error_descriptions, args=(marker,)).wait()
    with pytest.raises(torchfeed.UnsafeReplyError, match="posix.system"):
        torchfeed.rpc_async(address, lambda: 1 / 0).wait()
    with pytest.raises(torchfeed.UnsafeReplyError):  # trusting the call's result does not extend to errors
        torchfeed.rpc_async(address, lambda: 1 / 0, trust_worker=True).wait()
    assert not os.path.exists(marker)
    _alive(address)


def test_stats_answer_is_json_and_runs_nothing(fresh_workers, marker):
    address = fresh_workers(1).addresses[0]
    stats = torchfeed.client.worker_stats(address)
    assert json.loads(json.dumps(stats)) == stats  # plain JSON
    torchfeed.rpc_async(address, _send_hostile_stats, args=(marker,)).wait()
    with pytest.raises(
        torchfeed.SerializationError, match=f"worker {address} answered with bytes that are not JSON"
    ):
        torchfeed.client.worker_stats(address)
    # torchfeed top shows the worker's row as an error and exits normally
    out = subprocess.run(
        [sys.executable, "-m", "torchfeed", "top", "--once", "--json", address],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 1, out.stderr  # as for a worker that does not answer
    (row,) = json.loads(out.stdout)["workers"]
    assert "not JSON" in row["error"]
    assert not os.path.exists(marker)
    _alive(address)


class Mixed(torch.utils.data.Dataset):
    """Samples of every kind torchfeed loads by default."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {
            "x": torch.arange(6, dtype=torch.float16).reshape(2, 3) + i,
            "t": torch.arange(4).reshape(2, 2).T * i,  # strided
            "np": np.full((2,), i, dtype=np.int32),
            "scalar": np.float32(i) / 2,
            "text": f"s{i}",
            "pair": (i, 1.5 * i, b"b"),
            "od": collections.OrderedDict(a=i),
        }


class Loose(Mixed):
    """And kinds that torch's collate does not take: samples travel as they are."""

    def __getitem__(self, i):
        return {
            **super().__getitem__(i),
            "shape": torch.Size([i, 2]),
            "none": None,
            "complex": 1j * i,
            "set": {i, -i},
            "frozen": frozenset([i]),
            "bytes": bytearray(b"xy"),
            "obj": np.array([i, "x", None], dtype=object),
            "dtypes": (torch.int64, np.dtype("<f8"), np.dtype([("a", "u1"), ("b", "<f4")])),
            "device": torch.device("cpu"),
            "grad": torch.ones(2, requires_grad=True),
        }


@pytest.mark.parametrize("cls, batch_size", [(Mixed, 3), (Loose, None)])
def test_ordinary_batches_load_unchanged(workers2, cls, batch_size):
    # what torch's DataLoader yields for the same dataset, through the restricted loader
    remote = list(torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(workers2, cls), batch_size=batch_size))
    local = list(torch.utils.data.DataLoader(cls(), batch_size=batch_size))
    assert len(remote) == len(local) > 1
    for r, t in zip(remote, local):
        assert r.keys() == t.keys()
        for key in r:
            assert type(r[key]) is type(t[key]) and repr(r[key]) == repr(t[key]), key


def test_add_safe_globals_lets_a_users_class_through(workers2, allowlist):
    ds = torchfeed.RemoteDataset(workers2, Records)
    with pytest.raises(torchfeed.UnsafeReplyError, match=r"test_safe_replies\.Record") as info:
        list(torchfeed.RemoteDataLoader(ds, batch_size=None))
    assert "torchfeed.add_safe_globals([Record])" in str(info.value)
    # per loader
    got = list(torchfeed.RemoteDataLoader(ds, batch_size=None, safe_globals=[Record]))
    assert [type(r) for r in got] == [Record] * 6 and [r.label for r in got] == list(range(6))
    # per process
    torchfeed.add_safe_globals([Record])
    assert Record in torchfeed.get_safe_globals()
    got = list(torchfeed.RemoteDataLoader(ds, batch_size=2, collate_fn=list))
    assert type(got[0][0]) is Record and [r.label for r in got[0]] == [0, 1]
    # per session
    torchfeed.clear_safe_globals()
    with torchfeed.Session(safe_globals=[Record]) as session:
        assert session.rpc_async(workers2[0], Records().__getitem__, args=(4,)).wait().label == 4


# -- the rebuild helpers and the unpickler, on crafted pickles (no worker needed) ----------


class _Calls:
    """Pickles as ``func(*args)``: how a crafted reply names any function."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _load(obj):
    meta, buffers = serialize.dumps_reply(obj)  # as a worker sends it
    return replies.SAFE.loads(meta, buffers)


@pytest.mark.parametrize(
    "crafted, named",
    [
        (_Calls(os.system, "true"), "posix.system"),
        (_Calls(getattr, "text", "upper"), "builtins.getattr"),
        (_Calls(torch.load, "x"), "torch.serialization.load"),
        (_Calls(eval, "1"), "builtins.eval"),
        (_Calls(np.frombuffer, b"\0" * 8), "numpy.frombuffer"),
        (_Calls(collections.namedtuple, "T", "a"), "collections.namedtuple"),
    ],
)
def test_refused_globals_are_named(crafted, named):
    with pytest.raises(torchfeed.UnsafeReplyError) as info:
        _load(crafted)
    assert info.value.global_name == named


def test_rebuild_helpers_check_what_they_are_given():
    buf = bytearray(8)
    # a dtype taken from the pickle must be a torch dtype, not any attribute of torch
    for name in ("load", "save", "Tensor", "__builtins__"):
        with pytest.raises(torchfeed.UnsafeReplyError, match="not a torch dtype"):
            _load(_Calls(rebuild.rebuild_tensor, buf, name, (2,), False))
    with pytest.raises(torchfeed.UnsafeReplyError, match="shape"):
        _load(_Calls(rebuild.rebuild_tensor, buf, "float32", "2", False))
    assert _load(_Calls(rebuild.rebuild_tensor, buf, "float32", (2,), False)).tolist() == [0.0, 0.0]
    # no elements from nothing: an empty buffer is an empty tensor; a broadcast (stride 0)
    # may not reach far beyond the bytes that arrived
    with pytest.raises(torchfeed.UnsafeReplyError, match="without its bytes"):
        _load(_Calls(rebuild.rebuild_tensor, b"", "float32", (1 << 28,), False))
    with pytest.raises(torchfeed.UnsafeReplyError, match="elements of torch.float32 over 8 bytes"):
        _load(_Calls(rebuild.rebuild_tensor, buf, "float32", (1 << 40,), False, (0,)))
    # arrays: dtypes arrive as descriptions, built fresh by numpy, without objects
    assert _load(_Calls(rebuild.rebuild_ndarray, buf, "<f4", (2,))).tolist() == [0.0, 0.0]
    for spec in ("|O", [("a", "|O")], {"names": ["a"], "formats": ["|O"], "offsets": [0], "itemsize": 8}):
        with pytest.raises(torchfeed.UnsafeReplyError, match="dtype"):
            _load(_Calls(rebuild.rebuild_ndarray, buf, spec, (1,)))
    # an object array's items are loaded under the same rules
    with pytest.raises(torchfeed.UnsafeReplyError, match="posix.system"):
        _load(np.array([1, _Calls(os.system, "true")], dtype=object))
    # a class the worker sent by value is looked up by name, its value never loaded
    with pytest.raises(torchfeed.UnsafeReplyError, match="some.Class"):
        _load(_Calls(replies.rebuild_class, "some.Class", pickle.dumps(_Calls(os.system, "true"))))
    # torch dtypes by name: only dtypes
    assert _load(torch.bfloat16) is torch.bfloat16


class _CallsThenSets(_Calls):
    """Pickles as ``func(*args)`` followed by BUILD with ``state`` (``__setstate__``)."""

    def __init__(self, func, args, state):
        super().__init__(func, *args)
        self.state = state

    def __reduce__(self):
        return self.func, self.args, self.state


def _forged_dtype() -> np.dtype:
    """A V8 dtype whose field is an object pointer while its flags say it holds none."""
    d = np.dtype("V8", False, True)
    d.__setstate__((3, "|", None, ("a",), {"a": (np.dtype("O"), 0)}, 8, 1, 0))  # type: ignore[attr-defined]  # numpy's unpickling hook, forged on purpose
    return d


def test_a_dtype_is_never_taken_from_the_pickle():
    # the red team's dtype with a hidden object field: its bytes would be read as pointers
    forged = _forged_dtype()
    for crafted in (forged, np.zeros(1, dtype="V8").view(forged), _Calls(np.dtype, "V8", False, True)):
        with pytest.raises(torchfeed.UnsafeReplyError, match="Python objects|numpy.dtype"):
            _load(crafted)
    # a fresh dtype changed by BUILD after it was made: flags that claim objects
    with pytest.raises(torchfeed.UnsafeReplyError, match="changed after it was made"):
        _load(_CallsThenSets(rebuild.rebuild_dtype, ("|V8",), (3, "|", None, None, None, 8, 1, 63)))
    # numpy scalars travel as descriptions and bytes
    for value in (np.float32(1.5), np.int64(-3), np.str_("ab"), np.datetime64("2020-01-02"), np.bool_(True)):
        got = _load(value)
        assert type(got) is type(value) and got == value


def test_objects_a_rebuild_made_cannot_be_changed_by_the_pickle():
    import collections

    # an OrderedDict whose methods are shadowed by instance attributes (items() -> [])
    with pytest.raises(torchfeed.UnsafeReplyError, match="OrderedDict"):
        _load(_CallsThenSets(collections.OrderedDict, ([("x", 1)],), {"items": torch.Size}))
    # a tensor given backward hooks of the pickle's choice
    hooks = collections.OrderedDict([(0, torch.Size)])
    with pytest.raises(torchfeed.UnsafeReplyError, match="tensor"):
        _load(
            _CallsThenSets(
                rebuild.rebuild_tensor, (bytearray(8), "float32", (2,), False), (True, None, hooks)
            )
        )
    # plain OrderedDicts and tensors load
    assert _load(collections.OrderedDict(a=torch.ones(2)))["a"].tolist() == [1.0, 1.0]


def test_a_huge_broadcast_is_sent_dense(workers2):
    expanded = torch.arange(3, dtype=torch.float32).reshape(3, 1).expand(3, 8_000_000)  # 96 MB over 12 bytes
    back = torchfeed.rpc_async(workers2[0], lambda: expanded).wait()
    assert torch.equal(back, expanded)
    small = torch.ones(1).expand(1000)  # a small broadcast keeps its strides
    assert torchfeed.rpc_async(workers2[0], lambda: small).wait().stride() == (0,)


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a crash there fails the test, not the test process)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_deep_nesting_is_refused_before_it_overflows_the_stack():
    # a dict keyed by a tuple nested 300,000 deep: hashing it recursed in C and killed the process
    code = (
        "import torchfeed\n"
        "from torchfeed.protocol import replies\n"
        "deep = b'\\x80\\x05}' + b')' + b'\\x85' * 300_000 + b'Ns.'\n"
        "for load in (replies.SAFE.loads, replies.load_data):\n"
        "    try:\n"
        "        load(deep)\n"
        "    except torchfeed.UnsafeReplyError as e:\n"
        "        print('refused', 'levels deep' in str(e))\n"
    )
    done = _run(code)
    assert done.returncode == 0 and done.stdout.split() == ["refused", "True"] * 2, done
    # ordinary nesting loads
    nested: list = []
    for _ in range(200):
        nested = [nested, (1, 2)]
    assert _load({"x": nested, "pad": "p" * (64 << 10)})["x"] == nested


def test_a_pickle_the_scan_cannot_read_is_refused():
    # the C unpickler reads b"I0x1\n" (strtol), pickletools does not: the deep key behind it
    # went unscanned and crashed the process
    code = (
        "import torchfeed\n"
        "from torchfeed.protocol import replies\n"
        "deep = b'\\x80\\x05I0x1\\n0}' + b')' + b'\\x85' * 300_000 + b'Ns.'\n"
        "for load in (replies.SAFE.loads, replies.load_data):\n"
        "    try:\n"
        "        load(deep)\n"
        "    except torchfeed.UnsafeReplyError as e:\n"
        "        print('refused')\n"
    )
    done = _run(code)
    assert done.returncode == 0 and done.stdout.split() == ["refused"] * 2, done
    with pytest.raises(torchfeed.UnsafeReplyError, match="unknown pickle opcode 0xff"):
        replies.SAFE.loads(b"\x80\x05\xff" + b"t" * (picklescan.FEW_WRAPPINGS + 1))  # an unknown opcode


def _shared_tuples(levels: int, padding: int) -> bytes:
    """A dict keyed by t_levels, where t_(k+1) = (t_k, t_k): it unfolds to 2**levels objects."""
    body = b"\x80\x05}" + b")\x940"  # {} and t_0 = () memoized as 0 (and popped)
    for k in range(levels):
        body += b"h" + bytes([k]) + b"h" + bytes([k]) + b"\x86\x94"  # t_(k+1) = (t_k, t_k), memo k+1
        body += b"0" if k < levels - 1 else b""
    pad = b"X" + len("t" * padding).to_bytes(4, "little") + b"t" * padding + b"0"  # a string, dropped
    return body[:3] + pad + body[3:] + b"Ns."


def test_shared_structures_that_unfold_too_far_are_refused_when_walked():
    # padded past the byte counts that skip the walk: 2**40 objects from 400 bytes of structure
    with pytest.raises(torchfeed.UnsafeReplyError, match="unfold to more than"):
        replies.SAFE.loads(_shared_tuples(40, picklescan.FEW_WRAPPINGS + 1))
    small = _shared_tuples(8, picklescan.FEW_WRAPPINGS + 1)  # 256 objects: fine
    assert len(replies.SAFE.loads(small)) == 1


def test_a_tensor_cannot_be_given_other_memory_after_it_was_made():
    # Tensor.__setstate__ with 4 items calls set_(): an empty tensor resized to 16M elements
    grown = _CallsThenSets(
        rebuild.rebuild_tensor, (b"", "float32", (0,), False), (torch.empty(0), 0, (1 << 24,), (1,))
    )
    with pytest.raises(RuntimeError, match="not resizable"):  # refused by torch: nothing allocated
        _load(grown)


def test_a_dtype_description_may_not_fan_out():
    # one memoized description used 200 times at each of 8 levels: 200**8 parts
    spec: object = "<f4"
    for _ in range(8):
        spec = {
            "names": [f"f{i}" for i in range(200)],
            "formats": [spec] * 200,
            "offsets": [0] * 200,
            "itemsize": 4,
        }
    with pytest.raises(torchfeed.UnsafeReplyError, match="fields and subarrays in all"):
        _load(_Calls(rebuild.rebuild_dtype, spec))
    with pytest.raises(torchfeed.UnsafeReplyError, match="character string"):
        _load(_Calls(rebuild.rebuild_dtype, "u1," * 1000))


def test_a_traceback_description_may_not_amplify_itself():
    from torchfeed.protocol import tracebacks

    frame = {"text": "x" * 20_000}
    info: dict[str, Any] = {
        "traceback": "short",
        "template": "\x01\x000\n" * 20_000,
        "frames": [frame],
        "marker": "\x01\x00",
    }
    assert tracebacks.render(info) == "short"  # a short marker: the worker's text
    info["marker"] = "\x00torchfeed-frame-0123456789ab:"
    info["template"] = (info["marker"] + "0\n") * 20_000  # 400 MB if every line were filled
    assert tracebacks.render(info) == "short"


def test_lookups_of_refused_names_run_nothing_of_torch():
    # torch's module __getattr__ imports subsystems and calls functions behind deprecated names
    code = (
        "import pickle, sys, torchfeed\n"
        "from torchfeed.protocol import replies\n"
        "before = set(sys.modules)\n"
        "for name in ('has_cudnn', '_dynamo', 'onnx', 'load'):\n"
        "    try:\n"
        "        replies.SAFE.loads(b'\\x80\\x05ctorch\\n' + name.encode() + b'\\n.')\n"
        "    except torchfeed.UnsafeReplyError:\n"
        "        pass\n"
        "print(sorted(set(sys.modules) - before))\n"
    )
    done = _run(code)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done


def test_extension_codes_are_refused():
    import copyreg

    copyreg.add_extension("posix", "system", 240)
    try:
        assert pickle.loads(b"\x80\x02\x82\xf0.") is os.system  # plain pickle: cached from now on
        with pytest.raises(torchfeed.UnsafeReplyError, match="extension code"):
            replies.SAFE.loads(b"\x80\x02\x82\xf0.")
        with pytest.raises(torchfeed.UnsafeReplyError, match="extension code"):
            replies.load_data(b"\x80\x02\x82\xf0.")
    finally:
        copyreg.remove_extension("posix", "system", 240)


def test_error_descriptions_are_plain_data_and_rebuilt_from_allowed_types():
    try:
        raise KeyError("k")
    except KeyError as exc:
        info = errordata.describe_exception(exc)
    assert errordata.plain(info)
    assert replies.load_data(pickle.dumps(info)) == info
    err = errordata.rebuild_remote_error("w:1", replies.load_data(pickle.dumps(info)))
    assert isinstance(err, KeyError) and isinstance(err, torchfeed.RemoteError) and err.args == ("k",)
    # a crafted description: its "bases" name functions, not exception types; nothing is called
    crafted = dict(info, type="x.Y", bases=["builtins.eval", "posix.system", "builtins.exec"], args=("1",))
    err = errordata.rebuild_remote_error("w:1", crafted)
    assert type(err) is torchfeed.RemoteError and err.remote_type == "x.Y"
    # and an error pickle naming a global is refused before anything is called
    with pytest.raises(torchfeed.UnsafeReplyError, match="posix.system"):
        replies.load_data(pickle.dumps(_Calls(os.system, "true")))
    for garbage in ([1, 2], {"type": 3}, "text"):
        assert type(errordata.rebuild_remote_error("w:1", garbage)) is torchfeed.RemoteError


def test_safe_globals_arguments_are_checked():
    with pytest.raises(TypeError, match="list of classes"):
        torchfeed.add_safe_globals(Record)  # type: ignore[arg-type]  # a class, not a list: refused
    with pytest.raises(TypeError, match="no module and qualified name"):
        torchfeed.add_safe_globals([3])
