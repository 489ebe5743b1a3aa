"""torchfeed.audit: prove that an epoch delivered every sample exactly once.

Create the loaders with ``RemoteDataLoader(..., audit=True)``; their states then record the
sample keys each epoch delivered (:mod:`torchfeed.loader.audit` explains the record). After
the epoch, :func:`verify` checks the states the job saved: every rank's at the end and every
rank's at each checkpoint a resume started from. :func:`gather` collects every rank's record
in a running job (a collective: call it on every rank), for a job that writes one checkpoint
for all ranks (Lightning writes rank 0's) or checks an epoch as it ends.
"""

from __future__ import annotations

from typing import Any

from .loader.audit import Report, verify

__all__ = ["Report", "gather", "verify"]


def gather(loader: Any) -> list[dict]:
    """Every rank's audit record of ``loader`` as it stands now, in rank order: the loaders'
    ``state_dict()["audit"]`` all-gathered over ``torch.distributed`` (this rank's alone when
    no process group is initialised). A collective: every rank must call it."""
    import torch.distributed as dist

    record = loader.state_dict().get("audit")
    if record is None:
        raise ValueError("this loader keeps no audit record: create it with audit=True")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [record]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, record)
    return every
