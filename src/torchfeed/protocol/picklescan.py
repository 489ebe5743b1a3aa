"""A look at a reply's pickle before it is loaded: how deep it nests, and extension codes.

Two things the restricted unpickler cannot refuse by the globals it allows:

* Nesting: hashing a tuple nested a hundred thousand deep (a dict key: one byte of pickle
  per level) recurses in C without a guard and overflows the stack, killing the trainer.
  A pickle that cannot nest hashable objects more than :data:`SCAN_ABOVE` deep is not
  scanned (the usual reply: its tensors travel apart); others are, and one whose objects
  nest deeper than :data:`MAX_DEPTH` is refused.
* Extension codes (EXT1/2/4): the C unpickler returns an object cached by
  ``copyreg.add_extension`` without asking ``find_class``. torchfeed never sends them;
  when something in this process registered extensions, every reply is scanned and any
  extension code refused.
"""

from __future__ import annotations

import copyreg
import pickletools

from ..errors import UnsafeReplyError

SCAN_ABOVE = 16 << 10
MAX_DEPTH = 1000

_EXT = frozenset({"EXT1", "EXT2", "EXT4"})
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_INTO = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})  # fill stack_before[0]
_SKIP = frozenset({"PROTO", "FRAME", "STOP"})


# opcodes that can wrap an object in a hashable one (a tuple, or an allowed class made by a
# call): a pickle cannot nest hashable objects deeper than it has these bytes
_WRAPPING = (b"\x85", b"\x86", b"\x87", b"t", b"R", b"\x81", b"\x92")  # TUPLE1-3, TUPLE, REDUCE, NEWOBJ(_EX)


def check(meta: bytes) -> None:
    """Raise UnsafeReplyError if ``meta`` nests too deep or uses extension codes.

    Counting the bytes that could be wrapping opcodes (at C speed) bounds the depth of
    hashable nesting: a pickle is scanned opcode by opcode only when that bound exceeds
    :data:`SCAN_ABOVE` (a large pickle of many small tuples or of text).
    """
    if not _extensions_registered():
        if len(meta) <= SCAN_ABOVE or sum(meta.count(op) for op in _WRAPPING) <= SCAN_ABOVE:
            return
    try:
        _scan(meta)
    except UnsafeReplyError:
        raise
    except Exception:  # a malformed pickle: the unpickler says what is wrong with it
        return


def _extensions_registered() -> bool:
    return bool(getattr(copyreg, "_extension_registry", None))


def _scan(meta: bytes) -> None:
    # every stack entry is a cell [depth] (containers filled later update their cell, which
    # the memo shares); an object's depth is one more than its deepest part
    stack: list[list[int]] = []
    marks: list[int] = []
    memo: dict[int, list[int]] = {}
    for op, arg, _ in pickletools.genops(meta):
        name = op.name
        if name in _SKIP:
            continue
        if name in _EXT:
            raise UnsafeReplyError(
                "the reply uses a pickle extension code, which torchfeed never sends and does not load"
            )
        if name == "MARK":
            marks.append(len(stack))
            continue
        if name in _PUT or name == "MEMOIZE":
            if stack:
                memo[len(memo) if name == "MEMOIZE" else int(arg or 0)] = stack[-1]
            continue
        if name in _GET:
            stack.append(memo.get(int(arg or 0), [0]))
            continue
        if name == "DUP":
            stack.append(stack[-1] if stack else [0])
            continue
        before = op.stack_before
        parts: list[list[int]] = []
        if pickletools.markobject in before:
            start = marks.pop() if marks else 0
            parts, stack[start:] = stack[start:], []
            count = before.index(pickletools.markobject)
        else:
            count = len(before)
        taken = stack[len(stack) - count :] if count else []
        if count:
            del stack[-count:]
        if not op.stack_after:
            continue
        if name in _INTO and taken:  # the container's own cell grows with what goes in
            cell = taken[0]
            cell[0] = max(cell[0], 1 + max((c[0] for c in (*taken[1:], *parts)), default=-1))
        else:
            cell = [1 + max((c[0] for c in (*taken, *parts)), default=-1)]
        if cell[0] > MAX_DEPTH:
            raise UnsafeReplyError(
                f"the reply's objects nest more than {MAX_DEPTH} levels deep, which torchfeed does not load "
                "(structures that deep can overflow the stack when hashed)"
            )
        stack.extend([cell] * len(op.stack_after))
