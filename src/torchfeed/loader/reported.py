"""What a worker reports that the trainer sizes or steers anything by, checked first.

A worker's replies are loaded without running code (:mod:`torchfeed.protocol.replies`),
but their *values* are still the worker's: a dataset length, a number of shards, the
position of a stream's batch. Each is checked here for its type and range before a
sampler, a shard queue or a stream's books use it; a value out of range is an error that
names the worker, rather than a huge allocation or a pass that never ends.
"""

from __future__ import annotations

from typing import Any

from ..errors import ProtocolError, TorchfeedError
from ..worker.streams import BATCH, END, ERROR, NEED

MAX_LENGTH = 1 << 48
"""The largest dataset length a worker may report."""

MAX_SHARDS = 1 << 20
"""The most shards a dynamically sharded dataset may have (the trainer keeps the epoch's
order of them as a list: about 250 MB and 3 s per million)."""


def _shown(value: Any) -> str:
    """``value`` in a message, short whatever it is (a worker chose it)."""
    if type(value) in (int, bool):
        return repr(value) if value.bit_length() < 128 else f"an int of {value.bit_length()} bits"
    return f"a {type(value).__name__}"


def check_description(worker: str, described: Any) -> None:
    """What ``building.describe`` answered on ``worker``: (is iterable, length or None)."""
    if not (type(described) is tuple and len(described) == 2 and type(described[0]) is bool):
        raise ProtocolError(
            f"worker {worker} described its dataset with {_shown(described)}, not (is iterable, length): "
            "is it running the same torchfeed version as this process?"
        )
    length = described[1]
    if length is not None and not (type(length) is int and 0 <= length <= MAX_LENGTH):
        raise TorchfeedError(
            f"worker {worker} reports a dataset length of {_shown(length)}: a length is an int from 0 to "
            f"{MAX_LENGTH} (what does the dataset's __len__ return there?)"
        )


def shard_plan(worker: str, plan: Any) -> tuple[int, bool, int | None]:
    """A dynamically sharded dataset's ``(number of shards, shuffle, seed)`` from ``worker``."""
    if not (type(plan) is tuple and len(plan) == 3):
        raise ProtocolError(
            f"worker {worker} answered the shard plan with {_shown(plan)}, not (number of shards, shuffle, "
            "seed): is it running the same torchfeed version as this process?"
        )
    count, shuffle, seed = plan
    if type(count) is not int or not 0 <= count <= MAX_SHARDS:
        raise TorchfeedError(
            f"worker {worker} reports {_shown(count)} shards for its dataset: a sharded dataset has from 0 to "
            f"{MAX_SHARDS} shards (the trainer keeps their order); group the data into fewer, larger shards"
        )
    if type(shuffle) not in (bool, int) or (seed is not None and type(seed) is not int):
        raise TorchfeedError(
            f"worker {worker} reports shuffle={_shown(shuffle)}, seed={_shown(seed)} for its shards: shuffle "
            "is a bool and seed an int or None"
        )
    return count, bool(shuffle), seed


def stream_reply(worker: str, value: Any) -> tuple:
    """A stream's reply ``(number, kind, payload, state, rng, taken)`` (see ``Stream.__call__``)."""
    if type(value) is tuple and len(value) == 6:
        number, kind, taken = value[0], value[1], value[5]
        if (
            type(number) is int
            and number >= 0
            and type(kind) is int
            and kind in (BATCH, END, ERROR, NEED)
            and type(taken) is int
            and taken >= 0
        ):
            return value
    raise ProtocolError(
        f"worker {worker} answered a request of an iterable-style stream with {_shown(value)} that is not a "
        "stream's reply (number, kind, payload, state, rng, taken): is it running the same torchfeed version?"
    )
