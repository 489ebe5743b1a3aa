"""Remote tracebacks whose frames of trainer code show the trainer's source.

Functions and classes defined in ``__main__``, inside functions or in a notebook reach a
worker by value: their code objects are rebuilt there from the trainer's pickle. The
worker usually has no copy of their source file (another machine, a notebook cell), and
cloudpickle 3 even renames their file ``<dynamic-code>``. Three pieces put the right
file and source line back into the traceback the trainer shows:

* :func:`rebuild_code` (the trainer's pickler makes code objects rebuild through it)
  restores the code's real file name on the worker and remembers that code object as
  sent by value;
* :func:`describe` (worker) formats a traceback as Python does, and also returns it as a
  template in which each frame is a placeholder line, plus the frames as plain data
  (file, line, name, positions, whether the code was sent, the worker's rendering);
* :func:`render` (trainer) fills the template in: frames of code the trainer sent are
  rendered from the trainer's own source through :mod:`linecache` (caret lines
  included where this Python draws them); every other frame, and every frame whose
  source the trainer does not have, keeps the worker's rendering.

Everything here is standard library only: the command line imports it before torch.
"""

from __future__ import annotations

import linecache
import os
import secrets
import sys
import textwrap
import traceback
import types
import weakref
from collections.abc import Callable
from typing import Any

# -- trainer: the files whose code this process sent by value ------------------------------

# Only these are read to render a worker's frames: a worker names any file it likes, and the
# trainer must not open another path (a FIFO would hang it) on a worker's word.
_sent_files: set[str] = set()


def sending(filename: str) -> None:
    """Trainer side: code of ``filename`` is being sent by value (its frames may be rendered)."""
    _sent_files.add(filename)


def _readable_here(filename: str) -> bool:
    """A file this process sent code of, and whose source it has: in linecache already (a
    notebook cell) or a regular file."""
    if filename not in _sent_files:
        return False
    if filename in linecache.cache:
        return True
    try:
        return os.path.isfile(filename)
    except (OSError, ValueError):
        return False


# -- worker: which code objects came from the trainer by value -----------------------------

# id -> code object; an entry leaves with its code object (and only then: an id reused
# by a newer code object keeps the newer entry)
_sent: weakref.WeakValueDictionary[int, types.CodeType] = weakref.WeakValueDictionary()


def rebuild_code(make: Callable[..., types.CodeType], args: tuple, filename: str) -> types.CodeType:
    """Unpickling hook: ``make(*args)``, named ``filename`` and remembered as sent by value."""
    code = make(*args)
    if isinstance(filename, str) and code.co_filename != filename:
        code = code.replace(co_filename=filename)
    _sent[id(code)] = code
    return code


def was_sent(code: types.CodeType) -> bool:
    """Whether ``code`` was rebuilt by :func:`rebuild_code` (its source is the trainer's)."""
    return _sent.get(id(code)) is code


# -- worker: a traceback as text, template and frames --------------------------------------

_CUTOFF = 3  # as Python: a frame repeated more often is summarised after three


class _Placeholders(traceback.StackSummary):
    """A stack that formats as one placeholder line per frame shown, collecting the frames."""

    codes: list[types.CodeType] | None
    sink: _Frames

    def format(self, **kwargs: Any) -> list[str]:  # colorize (3.13): never asked for here
        out: list[str] = []
        last: tuple | None = None
        count = 0
        for index, summary in enumerate(self):
            key = (summary.filename, summary.lineno, summary.name)
            if key != last:
                out.extend(_repeated(count))
                last, count = key, 0
            count += 1
            if count <= _CUTOFF:
                code = self.codes[index] if self.codes is not None else None
                out.append(self.sink.add(summary, code))
        out.extend(_repeated(count))
        return out


def _repeated(count: int) -> list[str]:
    if count <= _CUTOFF:
        return []
    more = count - _CUTOFF
    return [f"  [Previous line repeated {more} more time{'s' if more > 1 else ''}]\n"]


class _Frames:
    def __init__(self) -> None:
        self.marker = f"\0torchfeed-frame-{secrets.token_hex(6)}:"
        self.frames: list[dict[str, Any]] = []

    def add(self, summary: traceback.FrameSummary, code: types.CodeType | None) -> str:
        self.frames.append(
            {
                "filename": summary.filename,
                "lineno": summary.lineno,
                "name": summary.name,
                "end_lineno": getattr(summary, "end_lineno", None),
                "colno": getattr(summary, "colno", None),
                "end_colno": getattr(summary, "end_colno", None),
                "sent": code is not None and was_sent(code),
                "text": format_frame(summary),
            }
        )
        return f"{self.marker}{len(self.frames) - 1}\n"


def format_frame(summary: traceback.FrameSummary) -> str:
    """One frame as Python prints it in a traceback (header, source line, carets)."""
    return "".join(traceback.StackSummary.from_list([summary]).format())


_MAX_TEMPLATE = 1 << 20  # a longer traceback (a huge message) travels as its text only


def describe(exc: BaseException) -> dict[str, Any]:
    """Worker side: ``traceback`` (the text, as Python prints it), and ``template``,
    ``frames`` and ``marker`` for :func:`render` on the trainer."""
    tb_exc = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    sink = _Frames()
    _take_apart(tb_exc, exc, sink)
    template = "".join(tb_exc.format())
    text = fill(template, sink.frames, sink.marker, lambda frame: frame["text"])
    if len(template) > _MAX_TEMPLATE:
        return {"traceback": text}
    return {"traceback": text, "template": template, "frames": sink.frames, "marker": sink.marker}


def _take_apart(tb_exc: traceback.TracebackException, exc: BaseException, sink: _Frames) -> None:
    """Give every stack of the chain (causes, contexts, groups) placeholders."""
    pending = [(tb_exc, exc)]
    seen: set[int] = set()
    while pending:
        node, value = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack = _Placeholders(node.stack)
        codes = [frame.f_code for frame, _ in traceback.walk_tb(value.__traceback__)]
        stack.codes = codes if len(codes) == len(stack) else None  # e.g. sys.tracebacklimit
        stack.sink = sink
        node.stack = stack
        for attr in ("__cause__", "__context__"):
            inner, inner_value = getattr(node, attr, None), getattr(value, attr, None)
            if inner is not None and inner_value is not None:
                pending.append((inner, inner_value))
        inner_group = getattr(node, "exceptions", None)  # exception groups (3.11)
        if inner_group:
            pending.extend(zip(inner_group, getattr(value, "exceptions", ())))


# -- trainer: the traceback to show --------------------------------------------------------


def fill(
    template: str, frames: list, marker: str, frame_text: Callable[[Any], str], limit: int | None = None
) -> str:
    """``template`` with each placeholder line replaced by ``frame_text(frame)``, indented
    as the placeholder was (the margins of exception groups). With ``limit`` (a description
    from elsewhere): ValueError once the text grows past ``limit`` characters or a frame is
    placed twice (a worker's description may not amplify itself)."""
    out = []
    size = 0
    placed: set[int] = set()
    for line in template.splitlines(keepends=True):
        margin, found, rest = line.partition(marker)
        index = rest.rstrip("\n")
        if not found or not index.isdigit() or int(index) >= len(frames):
            piece = line
        else:
            if limit is not None and int(index) in placed:
                raise ValueError("a frame placed twice")
            placed.add(int(index))
            piece = textwrap.indent(frame_text(frames[int(index)]), margin, lambda _line: True)
        size += len(piece)
        if limit is not None and size > limit:
            raise ValueError("the traceback grows past its limit")
        out.append(piece)
    return "".join(out)


def render(info: dict[str, Any]) -> str:
    """Trainer side: the remote traceback of a :func:`describe` dict, frames of code this
    process sent rendered from its own source (the worker's text where that fails)."""
    text = info.get("traceback", "")
    template, frames, marker = info.get("template"), info.get("frames"), info.get("marker")
    if not (isinstance(template, str) and isinstance(frames, list) and isinstance(marker, str) and marker):
        return text  # an older worker, a huge traceback, or a rebuilt RemoteError: as sent
    if len(marker) < 8:  # the worker's markers are long and random: a short one matches anything
        return text
    limit = 2 * len(text) + (1 << 20)  # frames rendered from this process's source may be longer
    try:
        return fill(template, frames, marker, _trainer_frame, limit)
    except Exception:  # a malformed (or amplifying) description: the worker's text is still right
        return text


def _trainer_frame(frame: dict[str, Any]) -> str:
    worker_text = str(frame.get("text", ""))
    filename, lineno, name = frame.get("filename"), frame.get("lineno"), frame.get("name")
    if not (frame.get("sent") and isinstance(filename, str) and isinstance(lineno, int)):
        return worker_text
    if not _readable_here(filename):
        return worker_text  # not a file whose code this process sent: never opened
    linecache.checkcache(filename)  # as Python does for a local traceback
    if not linecache.getline(filename, lineno).strip():
        return worker_text  # this process has no source for it either
    positions = {k: frame.get(k) for k in ("end_lineno", "colno", "end_colno")}
    if not all(value is None or isinstance(value, int) for value in positions.values()):
        positions = {}
    summary = _summary(filename, lineno, str(name), positions)
    try:
        return format_frame(summary)
    except Exception:
        return worker_text


def _summary(filename: str, lineno: int, name: str, positions: dict[str, Any]) -> traceback.FrameSummary:
    if sys.version_info >= (3, 11):
        return traceback.FrameSummary(
            filename,
            lineno,
            name,
            end_lineno=positions.get("end_lineno"),
            colno=positions.get("colno"),
            end_colno=positions.get("end_colno"),
        )
    return traceback.FrameSummary(filename, lineno, name)
