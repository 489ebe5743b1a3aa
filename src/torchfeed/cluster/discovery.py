"""Worker discovery: which data-loading workers this trainer process uses.

Addresses come from ``TORCHFEED_WORKERS`` or from an address file that ``torchfeed worker
--address-file`` appends to; they are split among the trainer ranks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from ..errors import Timeout, TorchfeedError
from ..protocol.addrfile import read_address_file
from .env import environment, int_var

ENV_WORKERS = "TORCHFEED_WORKERS"
ENV_ADDRESS_FILE = "TORCHFEED_ADDRESS_FILE"
ENV_NUM_WORKERS = "TORCHFEED_NUM_WORKERS"


read_addresses = read_address_file  # the format is the worker's: it writes these files


def wait_for_addresses(
    path: str, expected: int, timeout: float = 300.0, *, poll: float = 0.2, alive=None
) -> list[str]:
    """Wait until ``expected`` addresses are in ``path``; return the first ``expected``.

    ``alive``, a callable, is polled too: when it returns False (the workers' job step
    died) waiting stops with an error at once.
    """
    if expected < 1:
        raise ValueError(f"expected must be >= 1, got {expected}")
    deadline = time.monotonic() + timeout
    while True:
        found = read_addresses(path)
        if len(found) >= expected:
            return found[:expected]
        if alive is not None and not alive():
            raise TorchfeedError(
                f"the workers stopped before registering: {len(found)} of {expected} addresses in "
                f"{path}; see the workers' log"
            )
        if time.monotonic() >= deadline:
            raise Timeout(
                f"only {len(found)} of {expected} workers registered in {path} within {timeout:g} s: "
                f"check that the workers run (`torchfeed worker --address-file {path}`) and that "
                f"this path is on a file system they share with the trainers"
            )
        time.sleep(poll)


def workers(
    *,
    shared: bool = False,
    expected: int | None = None,
    address_file: str | None = None,
    timeout: float = 300.0,
    rank: int | None = None,
    world_size: int | None = None,
) -> list[str]:
    """This trainer's worker addresses (``host:port``).

    Taken from ``TORCHFEED_WORKERS`` (space- or comma-separated), or else from an address
    file written by ``torchfeed worker --address-file`` (``address_file`` or
    ``TORCHFEED_ADDRESS_FILE``), waiting until ``expected`` (or ``TORCHFEED_NUM_WORKERS``)
    workers have registered. Split among trainer ranks as ``workers[rank::world_size]``
    (with fewer workers than ranks, rank r uses worker ``r % n``), or all shared.

    Parameters
    ----------
    shared : bool
        Return every worker to every rank instead of splitting them.
    expected : int, optional
        Number of workers to wait for in the address file.
    address_file : str, optional
        Address file to read when ``TORCHFEED_WORKERS`` is not set.
    timeout : float
        Seconds to wait for the workers to register.
    rank, world_size : int, optional
        Default: from :func:`environment`.

    Returns
    -------
    list of str
    """
    listed = os.environ.get(ENV_WORKERS, "").replace(",", " ").split()
    if listed:
        addresses = list(dict.fromkeys(listed))
    else:
        path = address_file or os.environ.get(ENV_ADDRESS_FILE)
        if not path:
            raise TorchfeedError(
                f"no workers given: set {ENV_WORKERS}='host:port host:port ...', or start workers "
                f"with `torchfeed worker --address-file FILE` and pass address_file=FILE "
                f"(or set {ENV_ADDRESS_FILE})"
            )
        count = expected if expected is not None else int_var(os.environ, ENV_NUM_WORKERS, 1)
        addresses = wait_for_addresses(path, count, timeout)
    return split_workers(addresses, rank, world_size, shared=shared)


def split_workers(
    addresses: Sequence[str], rank: int | None = None, world_size: int | None = None, *, shared: bool = False
) -> list[str]:
    """``addresses[rank::world_size]`` (``[addresses[rank % n]]`` with fewer workers than ranks), or all."""
    addresses = list(addresses)
    if shared or not addresses:
        return addresses
    if rank is None or world_size is None:
        env = environment()
        rank = env.rank if rank is None else rank
        world_size = env.world_size if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    if world_size > len(addresses):
        return [addresses[rank % len(addresses)]]
    return addresses[rank::world_size]
