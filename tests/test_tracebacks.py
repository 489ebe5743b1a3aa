"""Remote tracebacks show the trainer's file and source line for code sent by value.

cloudpickle 3 names the code it sends by value ``<dynamic-code>``, and a worker without
the source file (another machine, a notebook cell) has no line to show: frames of code the
trainer sent must still name the trainer's file and show its source.
"""

from __future__ import annotations

import inspect
import linecache
import os
import pickle
import sys
import traceback

import pytest
from torch.utils.data import Dataset, IterableDataset

import torchfeed

pytestmark = pytest.mark.timeout(120)


def _where(func, snippet: str) -> tuple[int, str]:
    """Line number and stripped text of the first line of ``func`` containing ``snippet``."""
    lines, first = inspect.getsourcelines(func)
    for offset, line in enumerate(lines):
        if snippet in line:
            return first + offset, line.strip()
    raise AssertionError(f"{snippet!r} is not in {func}")


def _frame(filename: str, lineno: int, name: str, source: str) -> str:
    return f'  File "{filename}", line {lineno}, in {name}\n    {source}\n'


def _error_of(address, func) -> torchfeed.RemoteError:
    with pytest.raises(torchfeed.RemoteError) as info:
        torchfeed.rpc_async(address, func).wait()
    return info.value


def _assert_no_dynamic_code(text: str) -> None:
    assert "<dynamic-code>" not in text, text


# -- code defined in this test file ------------------------------------------------------


def test_rpc_frames_name_this_file_and_show_source(workers2):
    def outer():
        pick = lambda i: [10, 20][i]  # noqa: E731 - a lambda nested in a nested function
        return pick(5)

    err = _error_of(workers2[0], outer)
    assert isinstance(err, IndexError)
    text = err.remote_traceback
    _assert_no_dynamic_code(text)
    line, source = _where(outer, "return pick(5)")
    assert _frame(__file__, line, "outer", source) in text, text
    line, source = _where(outer, "pick = lambda")
    assert _frame(__file__, line, "<lambda>", source) in text, text
    assert text.rstrip().endswith("IndexError: list index out of range")
    # the rendered text is what a pickled copy (another process) carries
    assert pickle.loads(pickle.dumps(err)).remote_traceback == text


def test_map_style_dataset_frames_show_source(workers2):
    class Fragile(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            if i == 5:
                raise KeyError(f"sample {i} is missing")
            return i

    ds = torchfeed.RemoteDataset(workers2, Fragile)
    with pytest.raises(KeyError) as info:
        list(torchfeed.RemoteDataLoader(ds, batch_size=4))
    err = info.value
    assert isinstance(err, torchfeed.RemoteError) and err.indices == [4, 5, 6, 7]
    _assert_no_dynamic_code(err.remote_traceback)
    line, source = _where(Fragile.__getitem__, "raise KeyError")
    assert _frame(__file__, line, "__getitem__", source) in err.remote_traceback, err.remote_traceback


def test_dataset_construction_frames_show_source(workers2):
    class NeedsFiles(Dataset):
        def __init__(self, root):
            self.files = sorted(root.iterdir())

    with pytest.raises(AttributeError) as info:
        torchfeed.RemoteDataset(workers2, NeedsFiles, "/not/a/path/object")
    assert isinstance(info.value, torchfeed.RemoteError)
    text = info.value.remote_traceback
    _assert_no_dynamic_code(text)
    line, source = _where(NeedsFiles.__init__, "self.files =")
    assert _frame(__file__, line, "__init__", source) in text, text


def test_iterable_stream_frames_show_source(workers2):
    class Dries(IterableDataset):
        def __iter__(self):
            yield from range(3)
            raise RuntimeError("the source ran dry")

    ds = torchfeed.RemoteDataset(workers2[:1], Dries)
    with pytest.raises(RuntimeError, match="ran dry") as info:
        list(torchfeed.RemoteDataLoader(ds, batch_size=2))
    assert isinstance(info.value, torchfeed.RemoteError)
    text = info.value.remote_traceback
    _assert_no_dynamic_code(text)
    line, source = _where(Dries.__iter__, "raise RuntimeError")
    assert _frame(__file__, line, "__iter__", source) in text, text


# -- source only the trainer has ------------------------------------------------------------

_CELL = """\
def load(record):
    fields = record.split(",")
    return int(fields[3])


def parse_all(records):
    return [load(r) for r in records]
"""


def _define_cell(filename: str, source: str = _CELL) -> dict:
    """Run ``source`` as a notebook does: its lines are known to this process's linecache
    only (under ``filename``), and its functions travel by value."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"__name__": "torchfeed_test_cell"}  # not importable: by value
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def test_source_only_the_trainer_has_is_shown(workers2):
    filename = "/torchfeed-test/no-such-dir/cell_12.py"  # no worker can read it
    cell = _define_cell(filename)
    try:
        parse_all = cell["parse_all"]
        err = _error_of(workers2[0], lambda: parse_all(["a,b,c,4", "a,b"]))
    finally:
        del linecache.cache[filename]
    text = err.remote_traceback
    assert isinstance(err, IndexError)
    _assert_no_dynamic_code(text)
    assert _frame(filename, 7, "parse_all", "return [load(r) for r in records]") in text, text
    assert _frame(filename, 3, "load", "return int(fields[3])") in text, text
    if sys.version_info >= (3, 11):  # the caret line as Python draws it, from the trainer's source
        assert "    return int(fields[3])\n               ~~~~~~^^^\n" in text, text


def test_the_trainers_source_wins_over_a_workers_file(workers2, tmp_path):
    stale = tmp_path / "cell.py"  # what the workers could read: not what the trainer ran
    stale.write_text("# an older version of this file\n" * 10)
    cell = _define_cell(str(stale))
    try:
        load = cell["load"]
        err = _error_of(workers2[0], lambda: load("1,2"))
    finally:
        del linecache.cache[str(stale)]
    assert _frame(str(stale), 3, "load", "return int(fields[3])") in err.remote_traceback
    assert "an older version" not in err.remote_traceback


def test_frames_without_source_anywhere_stay_as_they_are(workers2):
    filename = "<generated at run time>"  # in no linecache, in no file
    namespace: dict = {"__name__": "torchfeed_test_generated"}
    exec(compile("def generated():\n    raise LookupError('made up')\n", filename, "exec"), namespace)
    generated = namespace["generated"]
    err = _error_of(workers2[0], lambda: generated())
    text = err.remote_traceback
    # the header as the worker wrote it, and no source line under it
    assert f'  File "{filename}", line 2, in generated\nLookupError: made up\n' in text, text
    # the worker's own frames keep the worker's rendering (its source lines included)
    assert "torchfeed/worker/serverconn.py" in text and "result = func(" in text, text
    line, source = _where(test_frames_without_source_anywhere_stay_as_they_are, "lambda: generated()")
    assert _frame(__file__, line, "<lambda>", source) in text, text


# -- the rendering itself, without workers ---------------------------------------------------


def _raise_chained():
    try:
        {"present": 0}["key"]
    except KeyError as exc:
        raise RuntimeError("while looking up") from exc


def _recurse(n):
    if n == 0:
        raise ValueError("bottom")
    return _recurse(n - 1)


@pytest.mark.parametrize("raiser", [_raise_chained, lambda: _recurse(30)])
def test_described_traceback_is_pythons_own_text(raiser):
    from torchfeed.protocol import errordata, tracebacks

    try:
        raiser()
    except Exception as exc:  # noqa: BLE001
        info = errordata.describe_exception(exc)
        expected = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert info["traceback"] == expected
    assert tracebacks.render(info) == expected  # nothing here was sent by value: as it was
    assert "[Previous line repeated" in expected or "direct cause" in expected


def test_malformed_descriptions_fall_back_to_the_text():
    from torchfeed.protocol import tracebacks

    text = "Traceback (most recent call last):\nValueError: x\n"
    marker = "\0marker:"
    for info in (
        {"traceback": text},
        {"traceback": text, "template": 3, "frames": [], "marker": marker},
        {"traceback": text, "template": f"{marker}0\n", "frames": ["not a frame"], "marker": marker},
    ):
        assert tracebacks.render(info) == text
    # a placeholder that names no frame stays a line of text
    info = {"traceback": text, "template": f"A\n{marker}7\n", "frames": [], "marker": marker}
    assert tracebacks.render(info) == f"A\n{marker}7\n"


def test_a_huge_traceback_travels_as_text_only():
    from torchfeed.protocol import tracebacks

    try:
        raise ValueError("x" * (2 << 20))
    except ValueError as exc:
        info = tracebacks.describe(exc)
        expected = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert set(info) == {"traceback"} and info["traceback"] == expected
    assert tracebacks.render(info) == expected


def test_a_worker_cannot_make_the_trainer_open_a_path_it_did_not_send_code_of(tmp_path):
    """The frames of a description are the worker's word: a path the trainer sent no code of
    is never opened (a FIFO would hang the trainer; any other file would be read)."""
    import threading

    from torchfeed.protocol import tracebacks

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    frame = {
        "sent": True,
        "filename": str(fifo),
        "lineno": 1,
        "name": "f",
        "text": '  File "x", line 1, in f\n',
    }
    marker = "\0torchfeed-frame-0123456789ab:"
    info = {"traceback": "worker text\n", "marker": marker, "template": f"T\n{marker}0\n", "frames": [frame]}
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(tracebacks.render(info)), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the open() it is stuck in, then fail
        with open(fifo, "w"):
            pass
        pytest.fail("the trainer opened a FIFO a worker named")
    assert out == ['T\n  File "x", line 1, in f\n']
