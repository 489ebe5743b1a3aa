"""rpc_async against real worker processes: functions, data round trips, remote
references, errors, timeouts, pinning and concurrency.

Helpers defined at module level here travel by reference (the workers import this
module: conftest.py puts tests/ on their PYTHONPATH); lambdas and local functions in the
tests travel by value.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import math
import os
import pickle
import subprocess
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchfeed
from helpers import named_workers_fixtures, wait_for
from torchfeed import client
from torchfeed.protocol import buffers, serialize

pytestmark = pytest.mark.timeout(60)

TESTS = Path(__file__).resolve().parent


# -- workers --------------------------------------------------------------------


# Private workers, started concurrently: main: two executors (a sleeping request does not
# block the others); spare: a second, harmless worker; victim: for the test that may break its
# executor.
_workers, worker = named_workers_fixtures(lambda _: {"main": {"parallel": 2}, "spare": {}, "victim": {}})


@pytest.fixture
def addr(worker):
    return worker[0]


def call(address, func, *args, timeout=20, **kwargs):
    return torchfeed.rpc_async(address, func, args=args, kwargs=kwargs, timeout=timeout).wait()


# -- functions of every kind ----------------------------------------------------------


def test_rpc_async_returns_a_torch_future(addr, worker):
    fut = torchfeed.rpc_async(addr, os.getpid)
    assert isinstance(fut, torch.futures.Future)
    assert fut.wait() == worker[1]
    assert fut.done() and fut.value() == worker[1]
    chained = torchfeed.rpc_async(addr, lambda: 20).then(lambda f: f.value() + 1)
    assert chained.wait() == 21
    assert (
        torch.futures.collect_all([torchfeed.rpc_async(addr, abs, args=(-i,)) for i in range(5)])
        .wait()[3]
        .value()
        == 3
    )


def test_lambdas_local_functions_closures_args_kwargs(addr):
    assert call(addr, lambda x, y=2: x * y, 21) == 42
    assert call(addr, lambda x, y=2: x * y, 5, y=3) == 15

    def helper(v):
        return v + 1

    def local(a, b, *rest, scale=1, **extra):
        return helper(a + b + sum(rest)) * scale, sorted(extra.items())

    assert call(addr, local, 1, 2, 3, 4, scale=10, z=1, y=2) == (110, [("y", 2), ("z", 1)])
    assert torchfeed.rpc_async(addr, local, args=[1, 1], kwargs={"scale": 2}).wait() == (6, [])

    captured = {"base": 100, "t": torch.arange(3)}

    def closure(i):
        return captured["base"] + i, captured["t"] * i

    n, t = call(addr, closure, 5)
    assert n == 105 and torch.equal(t, torch.tensor([0, 5, 10]))

    counter = [0]

    def make_adder(k):
        return lambda x: x + k + counter[0]

    assert call(addr, make_adder(7), 3) == 10

    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y

        def norm2(self):
            return self.x**2 + self.y**2

    assert call(addr, Point.norm2, Point(3, 4)) == 25
    assert call(addr, lambda p: (p.x, p.y), Point(1, 2)) == (1, 2)
    assert call(addr, functools.partial(pow, 2), 10) == 1024
    assert call(addr, math.factorial, 10) == 3628800
    assert call(addr, len, "abcd") == 4
    assert call(addr, lambda: None) is None


def test_result_may_be_an_instance_of_a_class_sent_by_value(addr):
    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y

    def move(p):
        return Point(p.x + 1, p.y)

    # not loaded unless allowed: the reply names the class, and nothing of it runs here
    with pytest.raises(torchfeed.UnsafeReplyError, match=r"test_rpc\.test_.*<locals>\.Point") as info:
        call(addr, move, Point(1, 2))
    assert info.value.global_name.endswith("<locals>.Point")
    # allowed for the call: an instance of this very class
    moved = torchfeed.rpc_async(addr, move, args=(Point(1, 2),), safe_globals=[Point]).wait()
    assert (type(moved), moved.x, moved.y) == (Point, 2, 2)
    # trusted: the class comes back by value, as before
    moved = torchfeed.rpc_async(addr, move, args=(Point(1, 2),), trust_worker=True).wait()
    assert (type(moved).__name__, moved.x, moved.y) == ("Point", 2, 2)


def test_module_level_functions_travel_by_reference(addr, worker):
    assert call(addr, where_am_i) == (worker[1], __name__)


def where_am_i():
    return os.getpid(), __name__


# -- tensors of every dtype -------------------------------------------------------------


def _creatable_dtypes():
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(dir(torch)):
            dtype = getattr(torch, name)
            if isinstance(dtype, torch.dtype) and dtype not in found:
                try:
                    torch.zeros((2, 3), dtype=dtype)
                except Exception:  # quantized dtypes and the like
                    continue
                found.append(dtype)
    return found


DTYPES = _creatable_dtypes()
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_id(dtype) -> str:
    return str(dtype).split(".", 1)[1]


def random_tensor(shape, dtype, seed: int) -> torch.Tensor:
    """Random bytes of any dtype (reproducible in every process)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).view(torch.bool)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's values as bytes, whatever its dtype, strides, conj or neg bits."""
    t = t.detach().resolve_conj().resolve_neg()
    size = t.element_size()
    if size in _SAME_SIZE_INT:
        t = t.view(_SAME_SIZE_INT[size])  # a same-size view works with any strides
    else:  # complex128
        t = torch.view_as_real(t).view(torch.int64)
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_digest(t: torch.Tensor):
    return (str(t.dtype), tuple(t.shape), t.requires_grad, hashlib.sha256(raw_bytes(t)).hexdigest())


def contiguous_variants(dtype, seed: int = 0) -> dict:
    out = {
        "plain": random_tensor((3, 5), dtype, seed),
        "scalar": random_tensor((), dtype, seed + 1),
        "empty": torch.empty((0, 3), dtype=dtype),
        "empty-3d": torch.empty((2, 0, 4), dtype=dtype),
        "single": random_tensor((1,), dtype, seed + 2),
        "4d": random_tensor((2, 1, 3, 2), dtype, seed + 3),
    }
    if dtype.is_complex:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z = random_tensor((6,), dtype, seed + 4)
            conj = z.conj()
            assert conj.is_conj()
            out["conj"] = conj
            neg = conj.imag
            if neg.is_neg():
                out["neg"] = neg
    if dtype.is_floating_point and dtype.itemsize >= 2:
        out["requires-grad"] = random_tensor((4,), dtype, seed + 5).requires_grad_(True)
    return out


def noncontiguous_variants(dtype, seed: int = 0) -> dict:
    return {
        "transposed": random_tensor((4, 6), dtype, seed).t(),
        "strided-slice": random_tensor((8, 6), dtype, seed + 1)[::2, 1::2],
        "expanded": random_tensor((1, 3), dtype, seed + 2).expand(4, 3),
        "permuted": random_tensor((2, 3, 4), dtype, seed + 3).permute(2, 0, 1),
    }


def digests(tree):
    """Worker-side (and local) fingerprint of a dict of tensors or of numpy arrays."""
    return {k: array_digest(v) if isinstance(v, np.ndarray) else tensor_digest(v) for k, v in tree.items()}


def check_each(got: dict, expected: dict, is_kind, same) -> None:
    """``got`` holds ``expected``'s keys, each value ``is_kind`` and of the dtype and shape of
    ``expected``'s, and ``same(got value, expected value, key)`` asserts the rest."""
    assert got.keys() == expected.keys()
    for key in expected:
        g, e = got[key], expected[key]
        assert is_kind(g), key
        assert g.dtype == e.dtype and g.shape == e.shape, key
        same(g, e, key)


def check_tensors(got: dict, expected: dict) -> None:
    def same(g: torch.Tensor, e: torch.Tensor, key: str) -> None:
        assert g.requires_grad == e.requires_grad, key
        assert raw_bytes(g) == raw_bytes(e), f"{key}: bytes differ"

    check_each(got, expected, lambda g: isinstance(g, torch.Tensor), same)


def check_results(address, make, dtype):
    """Tensors built on the worker arrive bit-exact."""
    check_tensors(call(address, make, dtype, 7), make(dtype, 7))


def check_arguments(address, make, dtype):
    """Tensors sent as arguments reach the worker bit-exact, and come back the same."""
    expected = make(dtype, 7)
    seen, echoed = call(address, lambda tree: (digests(tree), tree), expected)
    assert seen == digests(expected)
    check_tensors(echoed, expected)


def dtype_params():
    return [pytest.param(d, id=dtype_id(d)) for d in DTYPES]


def test_dtype_list_is_complete():
    names = {dtype_id(d) for d in DTYPES}
    for must in [
        "bfloat16",
        "bool",
        "complex64",
        "complex128",
        "float16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
    ]:
        assert must in names


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize(
    "make", [contiguous_variants, noncontiguous_variants], ids=["contiguous", "noncontiguous"]
)
@pytest.mark.parametrize("check", [check_results, check_arguments], ids=["results", "arguments"])
def test_tensors_of_every_dtype_arrive_bit_exact(addr, check, make, dtype):
    check(addr, make, dtype)


def test_call_arguments_carry_tensors_out_of_band():
    """Tensor arguments are sent from their memory, not copied into the pickle stream."""
    x = torch.arange(1 << 16, dtype=torch.float32)
    meta, buffers = serialize.dumps((len, (x,), {}), by_value=True)
    assert len(buffers) == 1 and memoryview(buffers[0]).nbytes == x.numel() * 4
    assert len(meta) < 4096


def test_result_tensors_are_writable_and_independent(addr):
    a, b = call(addr, lambda: (torch.arange(10.0), torch.ones(3, 3)))
    a += 1
    b[0, 0] = 7
    assert a[0] == 1 and b[0, 0] == 7


def test_large_results_do_not_alias(addr):
    """Results received into reused memory stay intact while they are alive."""
    n = 3 << 20  # above the pooling threshold, several receive chunks
    kept = []
    for i in range(4):
        kept.append(call(addr, lambda i: torch.full((n,), float(i)), i))
    for i, t in enumerate(kept):
        assert t.shape == (n,) and bool((t == i).all()), f"result {i} was overwritten"
    views = [t[:4] for t in kept]
    del kept
    gc.collect()
    for _ in range(3):
        call(addr, lambda: torch.full((n,), -1.0))
    for i, v in enumerate(views):
        assert torch.equal(v, torch.full((4,), float(i))), f"a view of result {i} was overwritten"


def test_large_tensor_argument_and_result(addr):
    x = random_tensor((5 << 20,), torch.float32, 3)  # 20 MB
    assert (
        call(addr, lambda t: hashlib.sha256(t.numpy().tobytes()).hexdigest(), x)
        == hashlib.sha256(x.numpy().tobytes()).hexdigest()
    )
    y = call(addr, lambda t: t, x)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


def test_many_buffers_in_one_message(addr):
    """More out-of-band buffers than one sendmsg takes, empty ones among them."""
    items: list[Any] = [torch.full((i % 5,), i, dtype=torch.int16) for i in range(1300)]
    items += [np.full(i % 3, i, dtype=np.int32) for i in range(300)]
    back = call(addr, lambda xs: xs, items)
    assert len(back) == len(items)
    for a, b in zip(items, back):
        assert type(a) is type(b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a.dtype == b.dtype and np.array_equal(a, b)


# -- numpy arrays --------------------------------------------------------------------


def numpy_arrays(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def rand_bytes(shape, dtype):
        dtype = np.dtype(dtype)
        raw = rng.integers(0, 256, size=math.prod(shape) * dtype.itemsize, dtype=np.uint8)
        return raw.view(dtype).reshape(shape)

    structured = np.dtype([("id", "<i4"), ("score", "<f8"), ("tag", "S3"), ("vec", "<f2", (2,))])
    out = {}
    dt: Any  # dtype names and numpy scalar types
    for dt in [
        "u1",
        "i1",
        "<u2",
        "<i2",
        "<u4",
        "<i4",
        "<u8",
        "<i8",
        ">i4",
        ">f8",
        "<f2",
        "<f4",
        "<f8",
        "<c8",
        "<c16",
        np.longdouble,
        np.clongdouble,
    ]:
        out[f"{np.dtype(dt).str}"] = rand_bytes((3, 4), dt)
    out.update(
        {
            "bool": rng.integers(0, 2, size=(5, 2)).astype(bool),
            "transposed": rand_bytes((3, 5), "<i4").T,
            "strided": rand_bytes((20,), "<f8")[::3],
            "reversed": np.arange(10, dtype=np.int64)[::-1],
            "fortran": np.asfortranarray(rand_bytes((3, 4), "<f4")),
            "sliced-2d": rand_bytes((6, 6), "<u2")[1::2, ::-2],
            "scalar-0d": np.array(3.25),
            "scalar-0d-int": np.array(7, dtype=np.uint64),
            "empty": np.zeros((0, 3), dtype=np.float32),
            "empty-struct": np.zeros((0,), dtype=structured),
            "structured": np.array(
                [(1, 2.5, b"ab", (1, 2)), (-3, np.nan, b"xyz", (0.5, -1))], dtype=structured
            ),
            "aligned-struct": np.zeros(3, dtype=np.dtype([("a", "u1"), ("b", "<f8")], align=True)),
            "structured-strided": np.zeros(6, dtype=structured)[::2],
            "datetime64": np.array(["2020-01-01T00:00", "2021-06-01T12:30", "NaT"], dtype="datetime64[m]"),
            "datetime64-ns": np.array([0, 1, 2, -5], dtype="datetime64[ns]"),
            "timedelta64": np.array([1, -2, 3], dtype="timedelta64[s]"),
            "unicode": np.array(["héllo", "wörld", ""]),
            "bytes": np.array([b"a", b"bcd"]),
            "void": np.frombuffer(b"0123456789", dtype="V5"),
            "object": np.array([1, "a", None, {"k": [1, 2]}, (3, 4)], dtype=object),
            "object-0d": np.array(None, dtype=object),
            "object-2d-strided": np.array([[1, "x"], [2.5, None], [b"z", 3]], dtype=object)[::2],
        }
    )
    return out


def array_digest(a: np.ndarray):
    if a.dtype.hasobject:
        body = pickle.dumps(a.tolist())
    else:
        body = np.ascontiguousarray(a).tobytes()
    return (type(a).__name__, a.dtype.str, a.dtype.descr, a.shape, hashlib.sha256(body).hexdigest())


def check_arrays(got: dict, expected: dict) -> None:
    def same(g: np.ndarray, e: np.ndarray, key: str) -> None:
        if e.dtype.hasobject:
            assert g.tolist() == e.tolist(), key
        else:
            assert np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(e).tobytes(), key

    check_each(got, expected, lambda g: type(g) is np.ndarray, same)


def test_numpy_roundtrip(addr):
    expected = numpy_arrays(11)
    assert call(addr, digests, expected) == digests(expected)
    check_arrays(call(addr, lambda tree: tree, expected), expected)
    check_arrays(call(addr, numpy_arrays, 11), expected)


def test_numpy_results_are_writable(addr):
    a = call(addr, lambda: np.arange(6.0).reshape(2, 3))
    a[0, 0] = 42
    assert a[0, 0] == 42


# -- nested structures -------------------------------------------------------------------


def nested(seed: int = 0):
    t = random_tensor((3, 2), torch.bfloat16, seed)
    return {
        "tensors": [random_tensor((4,), torch.int8, seed + 1), t.t(), torch.tensor(True)],
        "arrays": (np.arange(5, dtype=np.int16), np.array(["x", "yy"]), np.array(2.5)),
        "mixed": {
            "a": (1, "two", 3.0, None, b"bytes"),
            "b": [{"c": random_tensor((2, 2), torch.complex64, seed + 2)}],
        },
        "same-object-twice": [t, t],
        "empty": ([], {}, ()),
        7: frozenset({1, 2}),
    }


def check_nested(got, expected, path="root"):
    assert type(got) is type(expected), path
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape, path
        assert raw_bytes(got) == raw_bytes(expected), path
    elif isinstance(expected, np.ndarray):
        check_arrays({path: got}, {path: expected})
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), path
        for k in expected:
            check_nested(got[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            check_nested(g, e, f"{path}[{i}]")
    else:
        assert got == expected, path


def test_nested_structures(addr):
    expected = nested(5)
    back = call(addr, lambda tree: tree, expected)
    check_nested(back, expected)
    assert back["same-object-twice"][0] is back["same-object-twice"][1]  # sharing is kept
    check_nested(call(addr, nested, 5), expected)
    check_nested(call(addr, lambda **kw: kw, a=expected, b=[expected]), {"a": expected, "b": [expected]})


# -- remote references --------------------------------------------------------------------


class LiveMarker:
    """Objects kept on a worker; counted there by tag."""

    def __init__(self, tag: str):
        self.tag = tag
        self.items: list = []


def count_live(tag: str) -> int:
    gc.collect()
    return sum(
        1 for o in gc.get_objects() if type(o).__name__ == "LiveMarker" and getattr(o, "tag", None) == tag
    )


def test_remote_ref_usable_in_later_calls(addr):
    ref = torchfeed.rpc_async(addr, LiveMarker, args=("usable",), rref=True).wait()
    assert isinstance(ref, torchfeed.RemoteRef)
    assert ref.address == addr
    call(addr, lambda m, x: m.items.append(x), ref, 1)
    call(addr, lambda m, x: m.items.append(x), ref, x=torch.tensor([2]))  # noqa
    call(addr, lambda *, m: m.items.append(3), m=ref)
    call(addr, lambda box: box["m"][0].items.append(4), {"m": [ref]})  # nested in a container
    items = call(addr, lambda m: m.items, ref)
    assert items[0] == 1 and torch.equal(items[1], torch.tensor([2])) and items[2:] == [3, 4]
    # a method of the remote object as the function
    ref2 = torchfeed.rpc_async(addr, lambda m: m.items.__len__, args=(ref,), rref=True).wait()
    assert call(addr, lambda f: f(), ref2) == 4
    assert "RemoteRef" in repr(ref)


def test_remote_ref_is_freed_when_dropped(addr):
    ref = torchfeed.rpc_async(addr, LiveMarker, args=("dropped",), rref=True).wait()
    assert call(addr, count_live, "dropped") == 1
    del ref
    gc.collect()
    assert wait_for(lambda: call(addr, count_live, "dropped") == 0), "the worker kept a dropped reference"


def test_remote_ref_release(addr):
    ref = torchfeed.rpc_async(addr, LiveMarker, args=("released",), rref=True).wait()
    assert call(addr, count_live, "released") == 1
    ref.release()
    assert wait_for(lambda: call(addr, count_live, "released") == 0)
    with pytest.raises(torchfeed.RemoteError) as info:
        call(addr, lambda m: m, ref)
    assert "UnknownReference" in info.value.remote_type
    ref.release()  # idempotent


def test_remote_ref_on_another_worker_fails_clearly(addr, _workers):
    other = _workers["spare"][0]
    ref = torchfeed.rpc_async(addr, LiveMarker, args=("elsewhere",), rref=True).wait()
    with pytest.raises(torchfeed.RemoteError) as info:
        call(other, lambda m: m, ref)
    assert info.value.address == other
    assert "reference" in info.value.remote_message
    assert call(addr, lambda m: m.tag, ref) == "elsewhere"


def test_a_reference_lost_with_its_connection_is_worker_lost_before_anything_is_sent(addr):
    ref = torchfeed.rpc_async(addr, LiveMarker, args=("gone",), rref=True).wait()
    client.close_connections([addr])  # the worker frees what this connection held
    assert ref.closed
    # the next call opens a new connection, which the worker would refuse the reference on
    with pytest.raises(torchfeed.WorkerLost, match="lost with its connection"):
        torchfeed.rpc_async(addr, lambda m: m.tag, args=(ref,)).wait()
    assert call(addr, int) == 0  # the worker and the new connection serve on


CLIENT_SCRIPT = """
import os, sys
import torchfeed

class LiveMarker:
    def __init__(self, tag):
        self.tag = tag
        self.items = []

ref = torchfeed.rpc_async(sys.argv[1], LiveMarker, args=(sys.argv[2],), rref=True).wait()
print("ready", flush=True)
sys.stdin.readline()
os._exit(0)  # vanish: no release is sent, only the connection closes
"""


@pytest.mark.slow
def test_remote_refs_are_freed_when_the_client_disconnects(addr):
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, addr, "orphan"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        assert call(addr, count_live, "orphan") == 1
        proc.stdin.close()
        assert proc.wait(20) == 0
        assert wait_for(lambda: call(addr, count_live, "orphan") == 0), "references of a gone client leak"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_remote_ref_dropped_right_after_passing_it(addr):
    """``rpc_async(w, f, args=(ref,)); del ref`` must still see the object on the worker."""
    ref = torchfeed.rpc_async(addr, LiveMarker, args=("temporary",), rref=True).wait()
    call(addr, int)  # let the client's reader thread move past the reply holding ``ref``
    busy = [torchfeed.rpc_async(addr, time.sleep, args=(1.0,)) for _ in range(2)]  # both executors
    fut = torchfeed.rpc_async(addr, lambda m: m.tag, args=(ref,))
    del ref  # the caller keeps no reference: the release must wait for the call
    for b in busy:
        b.wait()
    assert fut.wait() == "temporary"


def test_dropped_results_are_not_retained_by_the_client(addr):
    t = torchfeed.rpc_async(addr, torch.zeros, args=(1000,)).wait()
    dead_tensor = weakref.ref(t)
    ref = torchfeed.rpc_async(addr, LiveMarker, args=("retained",), rref=True).wait()
    dead_ref = weakref.ref(ref)
    del t, ref
    gc.collect()
    assert dead_ref() is None, "a dropped RemoteRef is still referenced by the client"
    assert dead_tensor() is None


# -- errors --------------------------------------------------------------------------------


def test_remote_exception_becomes_remote_error(addr):
    def fails(x):
        raise ValueError(f"bad value {x}")

    with pytest.raises(torchfeed.RemoteError) as info:
        call(addr, fails, 42)
    err = info.value
    assert isinstance(err, torchfeed.TorchfeedError)
    assert err.address == addr
    assert err.remote_type == "ValueError"
    assert err.remote_message == "bad value 42"
    assert "Traceback" in err.remote_traceback and "fails" in err.remote_traceback
    assert "raise ValueError" in err.remote_traceback
    assert "bad value 42" in str(err) and addr in str(err)
    assert pickle.loads(pickle.dumps(err)).remote_traceback == err.remote_traceback
    assert call(addr, lambda: "still serving") == "still serving"


def test_remote_error_of_a_local_exception_class(addr):
    class DatasetBroken(RuntimeError):
        pass

    def fails():
        raise DatasetBroken("shard 3 is missing")

    with pytest.raises(torchfeed.RemoteError) as info:
        call(addr, fails)
    assert info.value.remote_type.endswith("DatasetBroken")
    assert "shard 3 is missing" in info.value.remote_message


def test_remote_error_with_broken_str(addr):
    class Weird(Exception):
        def __str__(self):
            raise RuntimeError("no str for you")

    def fails():
        raise Weird()

    with pytest.raises(torchfeed.RemoteError) as info:
        call(addr, fails)
    assert info.value.remote_type.endswith("Weird")


def test_unpicklable_result_is_a_remote_error(addr):
    with pytest.raises(torchfeed.RemoteError) as info:
        call(addr, lambda: threading.Lock())
    assert (
        "pickle" in (info.value.remote_type + info.value.remote_message + info.value.remote_traceback).lower()
    )
    assert call(addr, lambda: 1) == 1


def test_system_exit_in_user_code_is_a_remote_error(addr, worker):
    with pytest.raises(torchfeed.RemoteError) as info:
        call(addr, sys.exit, 3)
    assert info.value.remote_type == "SystemExit"
    assert call(addr, os.getpid) == worker[1]


def test_keyboard_interrupt_in_user_code_is_a_remote_error(_workers):
    address, pid = _workers["victim"]

    def interrupted():
        raise KeyboardInterrupt("from user code")

    with pytest.raises(torchfeed.RemoteError) as info:
        call(address, interrupted, timeout=1.5)
    assert info.value.remote_type == "KeyboardInterrupt"
    assert call(address, os.getpid, timeout=3) == pid


# -- timeouts -------------------------------------------------------------------------------


def test_timeout(addr):
    assert issubclass(torchfeed.Timeout, TimeoutError)
    assert issubclass(torchfeed.Timeout, torchfeed.TorchfeedError)
    start = time.monotonic()
    fut = torchfeed.rpc_async(addr, time.sleep, args=(2.5,), timeout=1.0)
    with pytest.raises(torchfeed.Timeout):
        fut.wait()
    # raised at all: the reply, 2.5 s away, did not come first; and not before the timeout
    assert time.monotonic() - start >= 0.9
    # the late reply is dropped quietly; the connection goes on
    assert call(addr, lambda: "after timeout") == "after timeout"
    conn = client.connect(addr)
    assert not conn.closed


# -- pin_memory -------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_pin_memory_without_cuda_warns_once(addr, monkeypatch):
    monkeypatch.setattr(buffers, "_warned_pin", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [
            torchfeed.rpc_async(
                addr, lambda i: torch.full((4, 4), float(i)), args=(i,), pin_memory=True
            ).wait()
            for i in range(3)
        ]
        big = torchfeed.rpc_async(addr, lambda: torch.ones(1 << 20), pin_memory=True).wait()
    for i, r in enumerate(results):
        assert torch.equal(r, torch.full((4, 4), float(i)))
    assert bool((big == 1).all())
    pin_warnings = [w for w in caught if "pin_memory" in str(w.message)]
    assert len(pin_warnings) == 1, [str(w.message) for w in caught]
    assert issubclass(pin_warnings[0].category, UserWarning)


# -- concurrency -------------------------------------------------------------------------------


def test_many_concurrent_requests_on_one_connection(addr):
    conn = client.connect(addr)

    def submit(thread_no):
        return [
            (
                thread_no,
                i,
                torchfeed.rpc_async(
                    addr, lambda t, i: (t, i, torch.full((i % 7 + 1,), t * 1000 + i)), args=(thread_no, i)
                ),
            )
            for i in range(50)
        ]

    with ThreadPoolExecutor(4) as pool:
        batches = list(pool.map(submit, range(4)))
    submitted = [x for batch in batches for x in batch]
    assert len(submitted) == 200
    assert client.connect(addr) is conn  # one connection carried them all
    for t, i, fut in submitted:
        rt, ri, tensor = fut.wait()
        assert (rt, ri) == (t, i)
        assert torch.equal(tensor, torch.full((i % 7 + 1,), t * 1000 + i))
    assert conn.num_pending() == 0


def test_concurrent_waiters_from_threads(addr):
    """Threads that submit and wait at the same time all get their own answers."""

    def work(k):
        futs = [torchfeed.rpc_async(addr, lambda a: a * 2, args=(k * 100 + i,)) for i in range(25)]
        return [f.wait() for f in futs] == [(k * 100 + i) * 2 for i in range(25)]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(8)))
