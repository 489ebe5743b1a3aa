"""Dask glue: DDP ranks on Dask workers, Dask-hosted torchfeed workers, results to the driver.

- :func:`run` runs a function once per Dask worker as a ``torch.distributed`` rank.
- :func:`start_workers` / :func:`stop_workers` turn any Dask cluster into a pool of
  torchfeed data-loading workers for :class:`torchfeed.RemoteDataset`.
- :class:`Pool` keeps a torchfeed worker next to every Dask worker as the cluster scales,
  for :func:`torchfeed.autoscale`.
- :class:`ResultsHandler` sends files (metrics, checkpoints) and metric dicts from the
  ranks back to the driver, which writes them under a local path or fsspec URL.

Dask is the control plane only: batches still travel over torchfeed's own connections.
Needs ``pip install 'torchfeed[dask]'``.
"""

try:
    import distributed  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "torchfeed.dask needs Dask's distributed package: pip install 'torchfeed[dask]'"
    ) from exc

from .pool import DaskPool, Pool
from .ranks import RankError, run
from .results import ResultsHandler
from .workers import WorkerAddresses, start_workers, stop_workers

__all__ = [
    "DaskPool",
    "Pool",
    "RankError",
    "ResultsHandler",
    "WorkerAddresses",
    "run",
    "start_workers",
    "stop_workers",
]
