"""Is a secret random enough? Refuse the low-variety, repeated and sequential ones.

Length alone lets ``"a" * 32``, ``"password" * 4`` or ``"0123456789abcdef" * 4`` through,
and an offline guessing attack on a recorded handshake tries such values first. Three
checks, each far from what a real random secret (``secrets.token_hex(16)`` and up,
``token_urlsafe``, ``token_bytes``, base64 of random bytes) can ever produce:

- too few different characters (fewer than :data:`MIN_DISTINCT`);
- one block repeated: the value has a period of at most half its length;
- too little estimated guessing work: each character counts the bits of the smallest
  usual alphabet holding the whole value (digits, hex, base64, printable, bytes), except
  characters that only repeat an earlier run (of at least 16 bits: 4 hex characters, 3
  base64 ones) or continue a run of equal steps (``abcd``, ``1357``, ``zzzz``), which
  count nothing. The total must reach
  :data:`MIN_ESTIMATED_BITS`, half of what the shortest accepted random secret
  (``token_hex(16)``: 32 hex characters, 128 bits) scores.

The figures for random secrets are in tests/test_security.py (many draws of each kind).
"""

from __future__ import annotations

import functools
import math
import string

MIN_DISTINCT = 6  # token_hex(16) has fewer with probability 3e-13
MIN_ESTIMATED_BITS = 64
REPEAT_BITS = 16  # a run of this many bits seen before is a repetition (32 random hex: p < 0.01)
_ALPHABETS = [  # (characters, bits per character), smallest first
    (frozenset(string.digits.encode()), math.log2(10)),
    (frozenset(string.hexdigits.encode()), 4.0),
    (frozenset((string.ascii_letters + string.digits + "+/=-_").encode()), 6.0),
    (frozenset(bytes(range(0x20, 0x7F))), math.log2(95)),
]


def _bits_per_char(value: bytes) -> float:
    present = set(value)
    for alphabet, bits in _ALPHABETS:
        if present <= alphabet:
            return bits
    return 8.0


def shortest_period(value: bytes) -> int:
    """The smallest ``p`` with ``value[i] == value[i + p]`` for every ``i`` (prefix function)."""
    border = [0] * len(value)
    k = 0
    for i in range(1, len(value)):
        while k and value[i] != value[k]:
            k = border[k - 1]
        if value[i] == value[k]:
            k += 1
        border[i] = k
    return len(value) - (border[-1] if value else 0)


def estimated_bits(value: bytes) -> float:
    """Guessing work in bits: characters that neither repeat an earlier run nor continue a sequence."""
    bits = _bits_per_char(value)
    length = math.ceil(REPEAT_BITS / bits)
    predictable = [False] * len(value)
    seen: set[bytes] = set()
    for i in range(len(value) - length + 1):
        run = value[i : i + length]
        if run in seen:
            predictable[i : i + length] = [True] * length
        seen.add(run)
    for i in range(3, len(value)):
        step = value[i] - value[i - 1]
        if step == value[i - 1] - value[i - 2] == value[i - 2] - value[i - 3]:
            predictable[i] = True
    return predictable.count(False) * bits


@functools.lru_cache(maxsize=64)  # explicit secrets are checked on every call that names one
def weakness(value: bytes) -> str | None:
    """What makes ``value`` guessable, in words that never show it; None when it looks random."""
    distinct = len(set(value))
    if distinct < MIN_DISTINCT:
        return f"it has only {distinct} different character{'s' * (distinct != 1)}"
    period = shortest_period(value)
    if period <= len(value) // 2:
        return f"it repeats one block of {period} characters"
    bits = estimated_bits(value)
    if bits < MIN_ESTIMATED_BITS:
        return (
            f"it is mostly repetitions and runs like 'abcd' or '1234' (an estimated {bits:.0f} bits "
            f"of guessing work; torchfeed needs {MIN_ESTIMATED_BITS})"
        )
    return None
