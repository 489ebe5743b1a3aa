"""A look at a reply's pickle before it is loaded: how deep and how large it unfolds.

Three things the restricted unpickler cannot refuse by the globals it allows:

* Nesting: hashing a tuple nested a hundred thousand deep (a dict key: one byte of pickle
  per level) recurses in C without a guard and overflows the stack, killing the trainer.
* Sharing: a pickle's memo lets one object appear many times, so ``t1 = (t0, t0)``,
  ``t2 = (t1, t1)``... 64 levels in 500 bytes make a dict key whose hash takes 2**64
  steps, in C, holding the GIL: the whole trainer hangs (and ``==`` and ``repr`` of such
  a value would too).
* Extension codes (EXT1/2/4): the C unpickler returns an object cached by
  ``copyreg.add_extension`` without asking ``find_class``. torchfeed never sends them.
* Memo indexes: a PUT of index n makes the C unpickler grow its memo to 2n slots (16 bytes
  per index, zeroed, holding the GIL) before anything else is checked, so 9 bytes
  (``\x80\x05N r <u32> .``) can ask for 64 GiB. A pickler numbers its memo slots in order
  (protocol 5 uses MEMOIZE, which takes the next slot), so a PUT may only overwrite a slot
  or take the next one: :func:`check` refuses any index beyond the slots filled so far.

:func:`check` walks the opcodes of a pickle keeping, for every object on the unpickler's
stack and in its memo, how deep it nests and how many objects it unfolds to (shared parts
counted each time they appear), and refuses a pickle beyond :data:`MAX_DEPTH` or
:data:`MAX_UNFOLDED`, with extension codes, or one it cannot read. The walk costs about a
microsecond an opcode (a list of 256 dicts of text: 2 ms, against 30 us to load it), so
it runs only where bytes counted at C speed do not already bound the depth: more than
:data:`FEW_WRAPPINGS` bytes that could wrap an object in a tuple or a call, or extension
codes registered in this process. The usual reply (a few tensors, whose bytes travel
apart) is never walked.

Memo indexes are checked in every pickle that could hold a far one: one regular-expression
search (C speed) looks for a byte ``r`` (LONG_BINPUT) followed by an index of
:data:`FREE_MEMO` or more, or ``p`` (PUT) followed by five or more digits. Where it finds
one :func:`memo_in_order` steps over the opcodes checking only the memo, about 0.3 us an
opcode (a third of the walk's cost). Text and global names usually hold such bytes, so most
replies are stepped: 8 us for a batch of two tensors (its load: 70 us), 0.3 ms for 64
samples of a tensor, a number and a file name (load: 1.5 ms). BINPUT's one-byte index
bounds its memo at 512 slots.

So sharing is caught only in pickles that are walked: a small pickle of shared tuples
still hangs the trainer (a known gap, see DESIGN.md; CPython versions that cache a tuple's
hash make that hash linear).
"""

from __future__ import annotations

import copyreg
import pickletools
import re
from typing import Any

from ..errors import UnsafeReplyError

MAX_DEPTH = 1000
MAX_UNFOLDED = 1 << 22  # objects, shared ones counted where they appear (besides the pickle's own size)
FEW_WRAPPINGS = 4096  # a key 4096 tuples deep hashes within even a 512 KiB thread stack

FREE_MEMO = 1 << 16  # memo indexes below this cost the unpickler at most 1 MiB: not searched for

# a LONG_BINPUT whose index is FREE_MEMO or more (one of its two high bytes set), or a PUT
# with five or more digits (int() also reads signs, spaces and underscores)
_FAR_PUT = re.compile(rb"r..(?!\x00\x00)|p[ \t\r\x0b\x0c+]*[0-9_]{5}", re.DOTALL)

_WRAPPING = (b"\x85", b"\x86", b"\x87", b"t", b"R", b"\x81", b"\x92", b"o", b"i")  # tuples and calls

# opcode byte -> (argument length: >= 0 fixed, or a code below; uses a mark; items popped
# below the mark or in all; objects pushed; kind)
_NEWLINE, _LEN1, _LEN4, _LEN8, _TWO_LINES = -1, -2, -4, -8, -9
_ARG_CODES = {
    pickletools.UP_TO_NEWLINE: _NEWLINE,
    pickletools.TAKEN_FROM_ARGUMENT1: _LEN1,
    pickletools.TAKEN_FROM_ARGUMENT4: _LEN4,
    pickletools.TAKEN_FROM_ARGUMENT4U: _LEN4,
    pickletools.TAKEN_FROM_ARGUMENT8U: _LEN8,
}
_KIND = {
    **dict.fromkeys(("PROTO", "FRAME", "STOP"), "skip"),
    **dict.fromkeys(("EXT1", "EXT2", "EXT4"), "ext"),
    **dict.fromkeys(("PUT", "BINPUT", "LONG_BINPUT"), "put"),
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), "get"),
    **dict.fromkeys(("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"), "into"),
    "MEMOIZE": "memoize",
    "MARK": "mark",
    "DUP": "dup",
}


def _table() -> list:
    table: list = [None] * 256
    for op in pickletools.opcodes:
        before = op.stack_before
        mark = pickletools.markobject in before
        if op.arg is None:
            arg = 0
        elif op.name in ("GLOBAL", "INST"):
            arg = _TWO_LINES
        else:
            arg = _ARG_CODES.get(op.arg.n, op.arg.n)
        pops = before.index(pickletools.markobject) if mark else len(before)
        pushes = 0 if op.name == "MARK" else len(op.stack_after)
        table[ord(op.code)] = (arg, mark, pops, pushes, _KIND.get(op.name, "op"), op.name)
    return table


_TABLE = _table()

# memo_in_order's table, one int an opcode: 1 + a fixed argument size; or a code (the
# three PUTs: _S_PUT, _S_PUT - 1, _S_PUT - 2; other arguments: _S_ARG + _TABLE's code)
_S_UNKNOWN, _S_LEN1, _S_MEMOIZE, _S_PUT, _S_ARG = 0, -1, -2, -3, -20
_PUT_ARGS: dict[int, int] = {_S_PUT: -1, _S_PUT - 1: 1, _S_PUT - 2: 4}
_PUT_NAMES: dict[int, str] = {}


def _steps() -> list[int]:
    steps = [_S_UNKNOWN] * 256
    for code, entry in enumerate(_TABLE):
        if entry is None:
            continue
        arg, kind, name = entry[0], entry[4], entry[5]
        if kind == "memoize":
            steps[code] = _S_MEMOIZE
        elif kind == "put":
            steps[code] = {"PUT": _S_PUT, "BINPUT": _S_PUT - 1, "LONG_BINPUT": _S_PUT - 2}[name]
            _PUT_NAMES[steps[code]] = name
        elif arg >= 0:
            steps[code] = 1 + arg
        elif arg == _LEN1:
            steps[code] = _S_LEN1
        else:
            steps[code] = _S_ARG + arg
    return steps


_STEPS = _steps()


def check(meta: bytes) -> None:
    """Raise UnsafeReplyError if ``meta`` nests or unfolds too far, uses extension codes or
    cannot be read (see the module's docstring)."""
    walk = _extensions_registered() or (
        len(meta) > FEW_WRAPPINGS and sum(map(meta.count, _WRAPPING)) > FEW_WRAPPINGS
    )
    if not walk and _FAR_PUT.search(meta) is None:
        return
    try:
        if walk:
            _walk(meta)
        else:
            memo_in_order(meta)
    except UnsafeReplyError:
        raise
    except Exception as exc:  # the C unpickler reads forms this walk does not (e.g. b"I0x1\n")
        raise UnsafeReplyError(f"the reply is not a pickle torchfeed reads ({exc!r:.120})") from None


def _extensions_registered() -> bool:
    return bool(getattr(copyreg, "_extension_registry", None))


def _too_far(depth: int, size: int, limit: int) -> None:
    if depth > MAX_DEPTH:
        raise UnsafeReplyError(
            f"the reply's objects nest more than {MAX_DEPTH} levels deep, which torchfeed does not load "
            "(structures that deep can overflow the stack when hashed)"
        )
    if size > limit:
        raise UnsafeReplyError(
            f"the reply's objects unfold to more than {limit} objects through shared references, which "
            "torchfeed does not load (hashing or comparing such a value would not end)"
        )


def _far(index: int, filled: int) -> UnsafeReplyError:
    return UnsafeReplyError(
        f"the reply stores an object in memo slot {index} while only {filled} slots are filled, "
        "which torchfeed does not load (picklers fill their memo in order; a far slot makes the "
        "unpickler allocate memory for every slot before it)"
    )


def _skip(meta: bytes, i: int, arg: int) -> int:
    """Where the argument starting at ``i`` ends (its form given by _TABLE's code)."""
    if arg >= 0:
        return i + arg
    if arg == _LEN1:
        return i + 1 + meta[i]
    if arg == _LEN4:
        return i + 4 + int.from_bytes(meta[i : i + 4], "little")
    if arg == _LEN8:
        return i + 8 + int.from_bytes(meta[i : i + 8], "little")
    i = meta.index(b"\n", i) + 1
    return meta.index(b"\n", i) + 1 if arg == _TWO_LINES else i


def memo_in_order(meta: bytes) -> None:
    """Raise UnsafeReplyError if a PUT in ``meta`` names a memo slot beyond the next free one
    (or an opcode is unknown); the opcodes are stepped over, nothing else is looked at."""
    filled, i, end, table = 0, 0, len(meta), _STEPS
    while i < end:
        step = table[meta[i]]
        i += 1
        if step > 0:  # the usual opcode: a fixed-size argument, no memo
            i += step - 1
        elif step == _S_LEN1:
            i += 1 + meta[i]
        elif step == _S_MEMOIZE:
            filled += 1
        elif step < _S_PUT - 2:  # an argument of 4 or 8 bytes' length, or lines
            i = _skip(meta, i, step - _S_ARG)
        elif step == _S_UNKNOWN:
            raise UnsafeReplyError(f"the reply has an unknown pickle opcode {meta[i - 1]:#04x}")
        else:
            start, i = i, _skip(meta, i, _PUT_ARGS[step])
            index = _index(meta, start, i, _PUT_NAMES[step])
            if index > filled or index < 0:
                raise _far(index, filled)
            filled += index == filled


def _walk(meta: bytes) -> None:
    # every object is a cell [depth, unfolded size]; containers filled later update their
    # cell, which the memo shares, so a reference counts what it refers to when it is used
    limit = MAX_UNFOLDED + len(meta)
    stack: list[list[int]] = []
    marks: list[int] = []
    memo: dict[int, list[int]] = {}
    i, end = 0, len(meta)
    while i < end:
        entry = _TABLE[meta[i]]
        if entry is None:
            raise UnsafeReplyError(f"the reply has an unknown pickle opcode {meta[i]:#04x}")
        arg, mark, pops, pushes, kind, name = entry
        start = i + 1
        i = _skip(meta, start, arg)
        if kind == "op":
            pass
        elif kind == "skip":
            continue
        elif kind == "ext":
            raise UnsafeReplyError(
                "the reply uses a pickle extension code, which torchfeed never sends or loads"
            )
        elif kind == "mark":
            marks.append(len(stack))
            continue
        elif kind in ("put", "memoize"):
            key = len(memo) if kind == "memoize" else _index(meta, start, i, name)
            if key > len(memo) or key < 0:  # slots fill in order: memo holds 0 .. len(memo) - 1
                raise _far(key, len(memo))
            memo[key] = stack[-1]
            continue
        elif kind == "get":
            stack.append(memo[_index(meta, start, i, name)])
            continue
        elif kind == "dup":
            stack.append(stack[-1])
            continue
        parts: list[list[int]] = []
        if mark:
            at = marks.pop()
            parts = stack[at:]
            del stack[at:]
        taken = stack[len(stack) - pops :] if pops else []
        if pops:
            del stack[-pops:]
        if kind == "into":  # the container's own cell grows with what goes in
            cell = taken[0]
            more = (*taken[1:], *parts)
            cell[0] = max(cell[0], 1 + max((c[0] for c in more), default=-1))
            cell[1] += sum(c[1] for c in more)
        elif pushes:
            inputs = (*taken, *parts)
            cell = [1 + max((c[0] for c in inputs), default=-1), 1 + sum(c[1] for c in inputs)]
        else:
            continue
        _too_far(cell[0], cell[1], limit)
        stack.extend([cell] * pushes)


def _index(meta: bytes, start: int, stop: int, name: str) -> int:
    if name in ("BINPUT", "BINGET"):
        return meta[start]
    if name in ("LONG_BINPUT", "LONG_BINGET"):
        return int.from_bytes(meta[start:stop], "little")
    return int(meta[start:stop])


_STRINGS = (
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "SHORT_BINSTRING",
    "BINSTRING",
    "STRING",
)


def global_names(meta: bytes) -> list[str]:
    """``module.name`` of every global ``meta`` names (GLOBAL, INST, and STACK_GLOBAL of the
    two strings pushed before it, as picklers write it), in order; what it cannot read ends
    the list. For an error message: nothing is loaded."""
    names: list[str] = []
    memo: dict[Any, object] = {}
    recent: list[object] = []  # the last two objects pushed (strings, or None for others)
    try:
        for op, arg, _ in pickletools.genops(meta):
            name = op.name
            if name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
                recent.append(None)
            elif name == "STACK_GLOBAL":
                if len(recent) >= 2 and all(isinstance(r, str) for r in recent[-2:]):
                    names.append(f"{recent[-2]}.{recent[-1]}")
                recent.append(None)
            elif name in _STRINGS:
                recent.append(arg if isinstance(arg, str) else None)
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = recent[-1] if recent else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(arg))
            elif name not in ("FRAME", "PROTO"):
                recent.append(None)
            del recent[:-2]
    except Exception:  # the load said what was refused; the rest of the list is a courtesy
        pass
    return names
