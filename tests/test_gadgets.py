"""A worker's objects run none of the trainer's methods; what holds data only loads as torch gives it.

A hostile worker cannot name a function in a reply, but it can make instances of the
trainer's plain classes and hand them to what a load does call: Python's special methods (a
dict key's ``__eq__``, a set member's ``__hash__``, a ``__call__`` stored where BUILD looks
up ``__setstate__``), the callables a reply may name (``complex``, ``torch.Size``,
``collections.OrderedDict``) and the rebuilding of an exception (``__init_subclass__``,
``__setattr__``). Each class here records any call of its special methods in ``CALLS``;
each crafted reply is first shown to run one under plain pickle (or a trusting policy), then
refused by the trainer with nothing recorded. Dict and list subclasses without methods of
their own and sparse tensors (their invariants checked) load as torch's DataLoader gives them.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
import pickletools
import typing
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torchfeed
from helpers import deep_equal
from torchfeed.protocol import errordata, plainclass, rebuild, replies, serialize

pytestmark = pytest.mark.timeout(120)

CALLS: list[str] = []


@pytest.fixture(autouse=True)
def _no_calls():
    CALLS.clear()
    yield
    CALLS.clear()


class Recorder:
    """Records its repr and str too: an error message about a refused object must not ask it."""

    def __repr__(self):
        CALLS.append("__repr__")
        return "Recorder()"

    def __str__(self):
        CALLS.append("__str__")
        return "Recorder"


@dataclasses.dataclass(unsafe_hash=True)
class SameKey:
    """Hashed by its fields (generated), compared by a hand-written __eq__."""

    k: int

    def __eq__(self, other):
        CALLS.append("__eq__")
        return False


@dataclasses.dataclass(frozen=True)
class Hashed:
    """A __hash__ written from source text (as code generators write them), not dataclasses' own."""

    k: int
    exec(compile("def __hash__(self):\n    CALLS.append('__hash__')\n    return 0\n", "<string>", "exec"))


class Index(Recorder):
    def __index__(self):
        CALLS.append("__index__")
        return 1


class Sized(Recorder):
    def __iter__(self):
        CALLS.append("__iter__")
        return iter((1,))

    def __len__(self):
        CALLS.append("__len__")
        return 1


class Mapping(Recorder):
    def keys(self):
        CALLS.append("keys")
        return ["k"]

    def __getitem__(self, key):
        CALLS.append("__getitem__")
        return 1


class Keys:
    """No special method: a plain class, but OrderedDict(Keys()) would call its keys()."""

    def keys(self):
        CALLS.append("keys")
        return []


class Complex(Recorder):
    def __complex__(self):
        CALLS.append("__complex__")
        return 1j


class Called(Recorder):
    def __call__(self, *args):
        CALLS.append("__call__")


class Plain:
    """Holds data only: loads by default."""


class Subclassed(ValueError):
    def __init_subclass__(cls, **kwargs):
        CALLS.append("__init_subclass__")
        super().__init_subclass__(**kwargs)


class Guarded(ValueError):
    def __setattr__(self, key, value):
        CALLS.append("__setattr__")
        super().__setattr__(key, value)


class _Calls:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _meta(obj) -> bytes:
    meta, buffers = serialize.dumps_reply(obj)
    assert not buffers
    return meta


def _load(obj, policy=replies.SAFE):
    return policy.loads(*serialize.dumps_reply(obj))


_HERE = __name__.encode()
# NEWOBJ Plain; BUILD {"__setstate__": Called()}; BUILD {"x": 1}: the second BUILD looks
# __setstate__ up on the instance, and finds the Called
_SETSTATE_CALL = (
    b"\x80\x02c" + _HERE + b"\nPlain\n)\x81"
    b"}X\x0c\x00\x00\x00__setstate__c" + _HERE + b"\nCalled\n)\x81sb"
    b"}X\x01\x00\x00\x00xK\x01sb."
)
# NEWOBJ on complex itself: complex.__new__(complex, Complex()) asks its __complex__
_NEWOBJ_COMPLEX = b"\x80\x02cbuiltins\ncomplex\nc" + _HERE + b"\nComplex\n)\x81\x85\x81."

# the nine paths: (what runs, the reply, the class whose method it is)
GADGETS = [
    ("__eq__ of dict keys", lambda: _meta({SameKey(1): 1, SameKey(1): 2}), SameKey),
    ("__hash__ of set members", lambda: _meta({Hashed(1)}), Hashed),
    ("__index__ of torch.Size's items", lambda: _meta(_Calls(torch.Size, [Index()])), Index),
    ("__iter__ and __len__ of torch.Size's argument", lambda: _meta(_Calls(torch.Size, Sized())), Sized),
    (
        "keys and __getitem__ of OrderedDict's argument",
        lambda: _meta(_Calls(collections.OrderedDict, Mapping())),
        Mapping,
    ),
    ("__complex__ of complex's argument", lambda: _meta(_Calls(complex, Complex())), Complex),
    ("__call__ found as an instance's __setstate__", lambda: _SETSTATE_CALL, Called),
]


@pytest.mark.parametrize("path, craft, cls", GADGETS, ids=[g[0] for g in GADGETS])
def test_a_reply_runs_no_special_method_of_the_trainers_classes(path, craft, cls):
    meta = craft()
    CALLS.clear()  # (building the reply here may have compared keys)
    pickle.loads(meta)  # plain pickle: the gadget is real
    assert CALLS, path
    CALLS.clear()
    with pytest.raises(torchfeed.UnsafeReplyError) as info:
        replies.SAFE.loads(meta)
    assert f"{__name__}.{cls.__qualname__}" in info.value.global_names
    reason = plainclass.why_not(cls)
    assert reason is not None and "it defines" in reason
    assert CALLS == []


@pytest.mark.parametrize(
    "craft, cls",
    [
        (lambda: _meta(_Calls(torch.Size, [Index()])), Index),
        (lambda: _meta(_Calls(torch.Size, (1, [Index()]))), Index),
        (lambda: _meta(_Calls(torch.Size, Sized())), Sized),
        (lambda: _meta(_Calls(torch.device, "cpu", Index())), Index),
        (lambda: _meta(_Calls(collections.OrderedDict, Mapping())), Mapping),
        (lambda: _meta(_Calls(collections.OrderedDict, Keys())), Keys),
        (lambda: _meta(_Calls(collections.OrderedDict, [(Keys(), 1)])), Keys),
        (lambda: _meta(_Calls(complex, Complex())), Complex),
        (lambda: _meta(_Calls(complex, 1.0, Complex())), Complex),
        (lambda: _NEWOBJ_COMPLEX, Complex),
    ],
    ids=[
        "Size-items",
        "Size-nested",
        "Size-iterable",
        "device-index",
        "OrderedDict-mapping",
        "OrderedDict-keys",
        "OrderedDict-pair-key",
        "complex",
        "complex-imag",
        "complex-NEWOBJ",
    ],
)
def test_the_callables_a_reply_may_name_are_given_plain_values_only(craft, cls):
    meta = craft()
    with pytest.raises(torchfeed.UnsafeReplyError):
        replies.SAFE.loads(meta)
    # refused where the class loads too: allowed by name (or Keys, which has no special method)
    for policy in (
        (replies.SAFE, replies.ReplyPolicy([cls])) if cls is Keys else (replies.ReplyPolicy([cls]),)
    ):
        with pytest.raises(torchfeed.UnsafeReplyError, match=f"with a {cls.__qualname__} value|pairs"):
            policy.loads(meta)
    assert CALLS == []


def test_what_those_callables_are_sent_by_a_worker_still_loads():
    values = [
        1 + 2j,
        complex(float("nan"), -0.0),
        torch.Size([2, 3]),
        torch.device("cpu"),
        torch.device("cpu", 0),
        collections.OrderedDict([("a", 1), ((1, "b"), [2.0])]),
    ]
    back = _load(values)
    assert repr(back) == repr(values) and [type(v) for v in back] == [type(v) for v in values]
    assert replies.load_data(pickle.dumps([1 + 2j])) == [1 + 2j]
    with pytest.raises(torchfeed.UnsafeReplyError, match="crafted"):  # a cycle costs nothing more
        replies.SAFE.loads(b"\x80\x02ctorch\nSize\n]q\x00h\x00ac" + _HERE + b"\nPlain\n)\x81a\x85R.")


@pytest.mark.parametrize("cls, method", [(Subclassed, "__init_subclass__"), (Guarded, "__setattr__")])
def test_an_error_frame_runs_no_special_method_of_the_trainers_exceptions(cls, method):
    try:
        raise cls("bad sample")
    except cls as exc:
        described = errordata.describe_exception(exc)
    info = replies.load_data(pickle.dumps({**described, "state": {"detail": 1}}))  # as the trainer gets it
    CALLS.clear()
    err = errordata.rebuild_remote_error("w:1", info)
    assert isinstance(err, ValueError) and isinstance(err, torchfeed.RemoteError) and not isinstance(err, cls)
    assert CALLS == []
    # a trusting policy rebuilds it as its own type: the gadget is real
    trusted = errordata.rebuild_remote_error("w:1", info, policy=replies.TRUSTED)
    assert isinstance(trusted, cls) and method in CALLS


# -- ordinary classes still load ------------------------------------------------------------

T = typing.TypeVar("T")


class Pair(typing.NamedTuple):
    left: int
    right: int

    def total(self) -> int:
        return self.left + self.right


Triple = collections.namedtuple("Triple", "a b c")


@dataclasses.dataclass(frozen=True, order=True)
class Version:
    major: int
    minor: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    x: int
    y: str


@dataclasses.dataclass
class Boxed(typing.Generic[T]):
    item: T
    tags: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.tags = list(self.tags)


class Described:
    """A plain class with the special methods no load calls."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Described({self.name!r})"

    def __str__(self) -> str:
        return self.name

    @property
    def upper(self) -> str:
        return self.name.upper()


@pytest.mark.parametrize(
    "value",
    [Pair(1, 2), Triple(1, "b", [3]), Version(1, 2), Slotted(3, "y"), Boxed(torch.ones(2), ["t"])],
    ids=lambda v: type(v).__name__,
)
def test_namedtuples_and_dataclasses_load_by_default(value):
    assert plainclass.why_not(type(value)) is None
    back = _load([value])[0]
    assert type(back) is type(value) and deep_equal(vars_of(back), vars_of(value))
    if isinstance(value, Version):  # a dict key: its generated __hash__ and __eq__ run
        assert back < Version(1, 3) and _load({value: 1, Version(1, 2): 2}) == {Version(1, 2): 2}


def vars_of(value):
    if isinstance(value, tuple):
        return list(value)
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def test_a_plain_class_with_only_inert_special_methods_loads():
    back = _load([Described("d"), Plain()])
    assert type(back[0]) is Described and back[0].upper == "D" and str(back[0]) == "d"
    assert type(back[1]) is Plain


# -- dict and list subclasses -------------------------------------------------------------


class Batch(dict):
    """A dict subclass with no methods of its own: loads by default."""


class Row(list):
    """A list subclass with no methods of its own: loads by default."""

    def __init__(self, *args):  # no load calls it
        super().__init__(*args)


class Totals(dict):
    def total(self):
        return sum(self.values())


class Setting(dict):
    def __setitem__(self, key, value):
        CALLS.append("__setitem__")
        super().__setitem__(key, value)


class Extending(list):
    def extend(self, values):
        CALLS.append("extend")
        super().extend(values)


class Appending(list):
    def append(self, value):
        CALLS.append("append")
        super().append(value)


def test_dict_and_list_subclasses_without_methods_load_filled_by_the_builtins():
    batch = Batch(x=torch.ones(2), y=3)
    vars(batch)["note"] = "kept"  # an attribute of the instance, which Batch does not declare
    row = Row([torch.zeros(1), "a"])
    back = _load([batch, row, {"nested": Batch(a=Row([1]))}])
    assert deep_equal(back[:2], [batch, row]) and back[0].note == "kept"
    assert type(back[2]["nested"]) is Batch and type(back[2]["nested"]["a"]) is Row


@pytest.mark.parametrize(
    "obj, called",
    [
        (Totals(a=1), None),
        (Setting(a=1), "__setitem__"),  # SETITEM(S): the type's __setitem__
        (Extending([1, 2]), "extend"),  # APPEND(S): extend, looked up on the object
        (Appending([1, 2]), None),  # append only where there is no extend
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, (dict, list)) else str(v),
)
def test_dict_and_list_subclasses_with_methods_stay_refused(obj, called):
    kind = "dict" if isinstance(obj, dict) else "list"
    reason = plainclass.why_not(type(obj))
    assert reason is not None and f"a {kind} subclass that defines {type(obj).__qualname__}." in reason
    CALLS.clear()
    with pytest.raises(torchfeed.UnsafeReplyError) as info:
        _load([obj])
    assert info.value.global_names == [f"{__name__}.{type(obj).__qualname__}"]
    assert CALLS == []
    back = _load([obj], replies.ReplyPolicy([type(obj)]))[0]  # allowed by name: what pickle calls runs
    assert type(back) is type(obj) and back == obj
    assert CALLS == ([called] if called else [])


# -- sparse tensors -----------------------------------------------------------------------


def _sparse(layout, *parts):
    """A reply of a sparse tensor as torch reduces one, its parts of the attacker's choosing."""
    return _Calls(torch._utils._rebuild_sparse_tensor, layout, parts)


def _t(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize(
    "reply, match",
    [
        (_sparse(torch.sparse_coo, _t([[0, 5]]), torch.ones(2), torch.Size([2]), False), "inconsistent"),
        (_sparse(torch.sparse_coo, _t([[-1, 0]]), torch.ones(2), torch.Size([2]), False), "inconsistent"),
        (_sparse(torch.sparse_coo, _t([[1, 0]]), torch.ones(2), torch.Size([2]), True), "inconsistent"),
        (_sparse(torch.sparse_coo, _t([[0]]), torch.ones(1), torch.Size([1]), "yes"), "is_coalesced"),
        (
            _sparse(torch.sparse_csr, _t([0, 1, 5]), _t([0, 1]), torch.ones(2), torch.Size([2, 2])),
            "inconsistent",
        ),
        (
            _sparse(torch.sparse_csr, _t([0, 1, 2]), _t([0, 7]), torch.ones(2), torch.Size([2, 2])),
            "inconsistent",
        ),
        (
            _sparse(torch.sparse_csc, _t([0, 2, 1]), _t([0, 1]), torch.ones(2), torch.Size([2, 2])),
            "inconsistent",
        ),
        (
            _sparse(torch.sparse_bsr, _t([0, 1]), _t([3]), torch.ones(1, 2, 2), torch.Size([2, 4])),
            "inconsistent",
        ),
        (
            _sparse(torch.sparse_coo, torch.eye(2).long().to_sparse(), torch.ones(2), torch.Size([2]), False),
            "not dense tensors",
        ),
        (_sparse(torch.strided, _t([[0]]), torch.ones(1), torch.Size([1]), False), "not a sparse layout"),
        (_sparse(torch.sparse_coo, _t([[0]]), torch.ones(1), torch.Size([1])), "not a sparse layout"),
    ],
)
def test_a_sparse_tensor_with_inconsistent_parts_is_refused(reply, match):
    with pytest.raises(torchfeed.UnsafeReplyError, match=match):
        _load(reply)


def _poked(value: int, repoint: bool = False):
    """A reply of [a tensor, a COO tensor whose indices view a bytearray, that bytearray],
    which then sets the bytearray's first byte to ``value`` (SETITEMS), after the COO tensor
    was made; with ``repoint``, it first points the indices tensor it made at the other
    tensor's bytes (BUILD: Tensor.__setstate__ -> set_())."""
    memory = bytearray(_t([[0, 1], [0, 1]]).numpy().tobytes())
    indices = _Calls(rebuild.rebuild_tensor, memory, "int64", (2, 2), False)
    sparse = _sparse(torch.sparse_coo, indices, torch.ones(2), torch.Size([2, 2]), True)
    meta, buffers = serialize.dumps_reply([_t([[0, 1], [0, 1]]), sparse, memory])
    ops = list(pickletools.genops(meta))
    names = [op[0].name for op in ops]
    assert names[:2] == ["PROTO", "FRAME"] and "FRAME" not in names[2:]
    assert names[-3:] == ["BINGET", "APPENDS", "STOP"]
    memo = [i for i, name in enumerate(names) if name == "MEMOIZE"]
    other = memo.index(names.index("REDUCE") + 1)  # the memo slots of the two tensors made
    made = memo.index(names.index("REDUCE", names.index("BYTEARRAY8")) + 1)
    inserted = b"(K\x00K" + bytes([value]) + b"u"  # MARK 0 value SETITEMS, on the bytearray
    if repoint:  # GET made, MARK GET other 0 (2, 2) (2, 1) TUPLE BUILD POP
        inserted += b"h" + bytes([made]) + b"(h" + bytes([other]) + b"K\x00K\x02K\x02\x86K\x02K\x01\x86tb0"
    unframed = meta[:2] + meta[11:]  # (framing is optional: the bytes inserted change its length)
    position = ops[-2][2]
    assert position is not None
    at = position - 9
    return unframed[:at] + inserted + unframed[at:], buffers


def test_a_sparse_tensor_whose_index_bytes_change_after_it_was_made_is_refused():
    back = replies.SAFE.loads(*_poked(1))  # the poke runs: index (0, 0) became (1, 0)
    assert back[1]._indices().tolist() == [[1, 1], [0, 1]] and back[2][0] == 1
    assert torch.equal(back[1].to_dense(), torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    back = replies.SAFE.loads(*_poked(1, repoint=True))  # the BUILD moves the part made, not the COO's
    assert back[1]._indices().tolist() == [[1, 1], [0, 1]]
    for repoint in (False, True):  # out of range once the load is done: checked again then
        with pytest.raises(torchfeed.UnsafeReplyError, match="inconsistent"):
            replies.SAFE.loads(*_poked(9, repoint))


# -- side by side with torch's DataLoader, on real workers ---------------------------------


class BatchSamples(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return Batch(x=torch.full((2,), float(i)), y=i, name=f"s{i}")


class RowSamples(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return Row([torch.full((3,), float(i)), i])


class SparseSamples(Dataset):
    """A sparse tensor of each layout (and a second COO one, not coalesced)."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        dense = torch.arange(16.0).reshape(4, 4) * (torch.eye(4) + torch.eye(4).roll(1, 0)) + i
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # compressed layouts warn that they are in beta
            made = [
                dense.to_sparse(),
                dense.to_sparse_csr(),
                dense.to_sparse_csc(),
                dense.to_sparse_bsr((2, 2)),
                dense.to_sparse_bsc((2, 2)),
                torch.sparse_coo_tensor(
                    torch.tensor([[3, 0, 3], [1, 2, 1]]), torch.tensor([1.0, 2.0, i]), (4, 4)
                ),
            ]
        return made[i]


def _same_sparse(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.layout == b.layout
        and a.dtype == b.dtype
        and a.shape == b.shape
        and (a.layout != torch.sparse_coo or a.is_coalesced() == b.is_coalesced())
        and torch.equal(a.to_dense(), b.to_dense())
    )


@pytest.mark.parametrize("dataset", [BatchSamples, RowSamples])
@pytest.mark.parametrize(
    "kw", [dict(batch_size=None), dict(batch_size=2), dict(batch_size=4, collate_fn=list)]
)
def test_dict_and_list_subclasses_come_back_as_torch_gives_them(workers2, dataset, kw):
    remote = list(torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(workers2, dataset), **kw))
    local = list(DataLoader(dataset(), **kw))
    assert len(remote) == len(local) and all(deep_equal(r, t) for r, t in zip(remote, local))
    first = remote[0][0] if kw.get("collate_fn") is list else remote[0]
    assert type(first) is (Batch if dataset is BatchSamples else Row)


@pytest.mark.parametrize("kw", [dict(batch_size=None), dict(batch_size=3, collate_fn=list)])
def test_sparse_tensors_come_back_as_torch_gives_them(workers2, kw):
    remote = list(torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(workers2, SparseSamples), **kw))
    local = list(DataLoader(SparseSamples(), **kw))
    flat = (lambda batches: [t for b in batches for t in b]) if "collate_fn" in kw else (lambda b: b)
    assert len(flat(remote)) == len(flat(local)) == 6
    assert all(_same_sparse(r, t) for r, t in zip(flat(remote), flat(local)))
    assert {t.layout for t in flat(remote)} == {
        torch.sparse_coo,
        torch.sparse_csr,
        torch.sparse_csc,
        torch.sparse_bsr,
        torch.sparse_bsc,
    }


def test_a_sparse_tensor_whose_dense_form_is_over_the_reply_limit_is_refused():
    """An empty COO tensor of size 2**62 costs nothing to send; to_dense() in the trainer would
    allocate what the worker chose: refused unless the limit allows it."""
    huge = torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.long), torch.zeros(0), (2**62,))
    with pytest.raises(torchfeed.UnsafeReplyError, match="once dense, over the reply limit"):
        _load(huge)
    small = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([2.0]), (4,))
    assert torch.equal(_load(small).to_dense(), torch.tensor([0.0, 2.0, 0.0, 0.0]))
