"""torchfeed: feed PyTorch training from data-loading workers on other machines.

Start workers with ``torchfeed worker`` and replace ``torch.utils.data.DataLoader`` with
:class:`RemoteDataLoader` over a :class:`RemoteDataset`.
"""

from .addrfile import UnsafeAddressFile
from .client import RemoteRef, rpc_async, set_heartbeat
from .errors import (
    AuthenticationError,
    FrameTooLarge,
    LimitExceeded,
    PoisonSampleError,
    ProtocolError,
    RemoteError,
    Timeout,
    TorchfeedError,
    WorkerLost,
)
from .loader import RemoteDataLoader
from .remote_dataset import RemoteDataset
from .local import LocalWorkers
from .sampling import DistributedSampler, set_random_seeds
from .worker import WorkerServer, run_worker

# Names of the design this project grew from, kept importable forever.
RPCDataset = RemoteDataset
RPCDataloader = RemoteDataLoader

__version__ = "0.1.0"

__all__ = sorted([
    "AuthenticationError",
    "DistributedSampler",
    "FrameTooLarge",
    "LimitExceeded",
    "LocalWorkers",
    "PoisonSampleError",
    "ProtocolError",
    "RPCDataloader",
    "RPCDataset",
    "RemoteDataLoader",
    "RemoteDataset",
    "RemoteError",
    "RemoteRef",
    "Timeout",
    "TorchfeedError",
    "UnsafeAddressFile",
    "WorkerLost",
    "WorkerServer",
    "rpc_async",
    "run_worker",
    "set_heartbeat",
    "set_random_seeds",
])
