"""Ordinary samples load by default; whatever could run code in the trainer stays refused.

Namedtuples, dataclasses and plain classes the trainer has imported rebuild without running
any code of theirs (protocol/plainclass.py), as do exception types rebuilt from their
arguments; classes with rebuild hooks of their own, classes of modules the trainer has not
imported and every callable are refused, each named, all at once.
"""

from __future__ import annotations

import argparse
import collections
import copyreg
import dataclasses
import os
import typing
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import torchfeed
from helpers import deep_equal
from torchfeed.protocol import plainclass, replies, serialize

pytestmark = pytest.mark.timeout(120)

Point = collections.namedtuple("Point", "x y")


class Sample(typing.NamedTuple):
    image: torch.Tensor
    label: int


@dataclasses.dataclass
class Box:
    corners: tuple
    name: str
    tags: list = dataclasses.field(default_factory=list)

    @property
    def area(self) -> float:  # a read-only property: nothing pickle could set through it
        return float(self.corners[0] * self.corners[1])


@dataclasses.dataclass(frozen=True)
class Key:
    shard: int
    row: int


class Loose:
    """A plain class whose constructor must never run in the trainer for a reply."""

    def __init__(self, path: str):
        self.path = path

    def touch(self) -> None:
        open(self.path, "w").close()


class Ran(Loose):
    def __init__(self, path: str):
        super().__init__(path)
        self.touch()  # runs only where the class is called


class Hooked:
    def __setstate__(self, state):
        raise AssertionError("ran")


class OwnNew:
    made = 0

    def __new__(cls, *args):
        OwnNew.made += 1  # code of the class's: runs only where it is allowed
        return super().__new__(cls)


class Setter:
    @property
    def value(self):
        return 1

    @value.setter
    def value(self, v):
        raise AssertionError("ran")


class Items(list):
    def extend(self, values):  # pickle's APPENDS calls it: a list subclass's own is code of the trainer's
        super().extend(values)


class Spiky(ValueError):
    def __reduce__(self):
        return Spiky, self.args


class Samples(Dataset):
    def __init__(self, boxes: bool = True):
        self.boxes = boxes  # dataclasses do not collate (torch's default_collate refuses them)

    def __len__(self):
        return 6

    def __getitem__(self, i):
        out: dict[str, object] = {"point": Point(i, -i), "sample": Sample(torch.full((3,), float(i)), i)}
        if self.boxes:
            out.update(box=Box((i + 1.0, 2.0), f"b{i}", ["t"] * i), key=Key(i, 2))
        return out


class _Calls:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _load(obj, policy=replies.SAFE):
    return policy.loads(*serialize.dumps_reply(obj))


@pytest.mark.parametrize(
    "boxes, kw",
    [(True, dict(batch_size=None)), (True, dict(batch_size=2, collate_fn=list)), (False, dict(batch_size=3))],
)
def test_namedtuples_and_dataclasses_load_by_default_as_torch_gives_them(workers2, boxes, kw):
    remote = list(torchfeed.RemoteDataLoader(torchfeed.RemoteDataset(workers2, Samples, boxes), **kw))
    local = list(DataLoader(Samples(boxes), **kw))
    assert len(remote) == len(local) and all(deep_equal(r, t) for r, t in zip(remote, local))
    first = remote[0][0] if isinstance(remote[0], list) else remote[0]
    assert type(first["point"]) is Point and type(first["sample"]) is Sample
    if boxes:
        assert type(first["key"]) is Key and type(first["box"]) is Box and first["box"].area == 2.0


def test_a_plain_class_is_built_without_running_its_code(tmp_path):
    marker = str(tmp_path / "ran")
    loose = Loose(marker)
    back = _load([loose, {Key(1, 2): loose}])
    assert type(back[0]) is Loose and back[0].path == marker and back[1] == {Key(1, 2): back[0]}
    # a pickle calling the class (REDUCE) gets an instance made without __init__
    made = _load(_Calls(Ran, marker))
    assert type(made) is Ran and vars(made) == {} and not os.path.exists(marker)
    with pytest.raises(torchfeed.UnsafeReplyError, match="Loose.touch"):  # its methods are callables
        _load(_Calls(Loose.touch, loose))
    assert not os.path.exists(marker)


@pytest.mark.parametrize(
    "cls, why",
    [
        (Hooked, "Hooked.__setstate__"),
        (OwnNew, "OwnNew.__new__"),
        (Setter, "a descriptor with a setter"),
        (Items, "list subclass"),
        (argparse.Namespace, "class of argparse"),
        (Spiky, "ValueError subclass"),  # exceptions travel as data (errordata.py), not in replies
    ],
)
def test_classes_that_could_run_code_stay_refused(cls, why):
    reason = plainclass.why_not(cls)
    assert reason is not None and why in reason
    obj = cls.__new__(cls) if cls is not Items else Items([1])
    with pytest.raises(torchfeed.UnsafeReplyError) as info:
        _load([obj])
    assert any(name.endswith(cls.__qualname__) for name in info.value.global_names)
    if cls in copyreg.dispatch_table:
        return  # pickled through a reducer registered for it (tblib's for exceptions, once imported)
    assert type(_load([obj], replies.ReplyPolicy([cls]))[0]) is cls  # allowed by name: loads


def test_a_module_the_trainer_has_not_imported_is_refused():
    # GLOBAL 'json.tool JSONThing' (json.tool is not imported here): nothing is imported
    assert "json.tool" not in __import__("sys").modules
    crafted = b"\x80\x02cjson.tool\nJSONThing\n)\x81."
    with pytest.raises(torchfeed.UnsafeReplyError, match="json.tool.JSONThing"):
        replies.SAFE.loads(crafted)
    assert "json.tool" not in __import__("sys").modules


def test_user_exceptions_are_their_type_unless_they_have_hooks(workers2):
    from compat_datasets import CorruptSample

    def corrupt():
        raise CorruptSample(3, "bad header")

    with pytest.raises(CorruptSample) as info:
        torchfeed.rpc_async(workers2[0], corrupt).wait()
    assert (info.value.index, info.value.reason) == (3, "bad header")
    assert isinstance(info.value, torchfeed.RemoteError)

    def spiky():
        raise Spiky("no")

    with pytest.raises(ValueError) as based:  # its nearest allowed base
        torchfeed.rpc_async(workers2[0], spiky).wait()
    assert not isinstance(based.value, Spiky) and isinstance(based.value, torchfeed.RemoteError)
    assert based.value.remote_type.endswith("Spiky")


def test_sparse_tensors_load_checked_nested_ones_need_their_name_and_the_error_names_all():
    import torch._utils as tu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested and CSR tensors warn that they are prototypes
        sparse = torch.eye(3).to_sparse()
        csr = torch.eye(3).to_sparse_csr()
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(torchfeed.UnsafeReplyError) as info:
        _load([sparse, nested, Hooked(), os.getcwd])
    names = ["torch._utils._rebuild_nested_tensor", f"{__name__}.Hooked"]
    assert info.value.global_names == [*names, "posix.getcwd"]
    assert "add_safe_globals([_rebuild_nested_tensor, Hooked, getcwd])" in str(info.value)
    for policy in (replies.SAFE, replies.ReplyPolicy([tu._rebuild_sparse_tensor])):  # by default, checked
        for t in (sparse, csr):
            back = _load(t, policy)
            assert back.layout == t.layout and torch.equal(back.to_dense(), torch.eye(3))
    back = _load(nested, replies.ReplyPolicy([tu._rebuild_nested_tensor]))
    assert [t.tolist() for t in back.unbind()] == [[1.0, 1.0], [1.0, 1.0, 1.0]]
    with pytest.raises(torchfeed.UnsafeReplyError, match="unknown torch layout"):
        replies.SAFE.loads(b"\x80\x02ctorch.serialization\n_get_layout\nX\x04\x00\x00\x00evil\x85R.")
