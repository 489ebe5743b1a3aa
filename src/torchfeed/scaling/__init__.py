"""Autoscaling: :func:`torchfeed.autoscale` and everything it drives, in one place.

- :mod:`~torchfeed.scaling.policy`: when to grow or shrink (pure decisions from readings);
- :mod:`~torchfeed.scaling.controller`: the controller thread behind :func:`torchfeed.autoscale`;
- :mod:`~torchfeed.scaling.pool`: what a pool of workers offers the controller (WorkerPool),
  and BasePool, what the pools with a background thread share;
- :mod:`~torchfeed.scaling.local_pool`: workers on the trainer's machine, up to a CPU budget;
- :mod:`~torchfeed.scaling.tiers`: several pools as one, the cheapest grown first, retired last.

The pools on each engine live in the engine's package, which imports this one (never the
reverse): ``torchfeed.dask.Pool``, ``torchfeed.ray.Pool`` and ``torchfeed.cluster.SlurmPool``.
Their old modules here (``dask_pool``, ``ray_pool``, ``slurm_pool``) are deprecated.

Names are imported on first use: the controller imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..deprecation import renamed_getattr
from ..util import lazy_exports

_EXPORTS = {
    "Autoscaler": "controller",
    "BasePool": "pool",
    "Decision": "policy",
    "LocalPool": "local_pool",
    "Policy": "policy",
    "WorkerPool": "pool",
    "Reading": "policy",
    "Tiers": "tiers",
    "autoscale": "controller",
}

__all__ = [
    "Autoscaler",
    "BasePool",
    "Decision",
    "LocalPool",
    "Policy",
    "Reading",
    "Tiers",
    "WorkerPool",
    "autoscale",
]
assert sorted(__all__) == sorted(_EXPORTS)

__getattr__ = renamed_getattr(
    __name__, {"Pool": "torchfeed.scaling.WorkerPool"}, lazy_exports(__name__, _EXPORTS)
)


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .controller import Autoscaler, autoscale
    from .local_pool import LocalPool
    from .policy import Decision, Policy, Reading
    from .pool import BasePool, WorkerPool
    from .tiers import Tiers
