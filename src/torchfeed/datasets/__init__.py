"""Datasets over any fsspec URL (``s3://``, ``gs://``, ``file://``, local paths...).

Install the storage client you need (``pip install 'torchfeed[dask]'`` brings fsspec and
s3fs). Both datasets list their files once, read each item with its own request,
retry transient storage errors, and work in DataLoader workers and as
:class:`torchfeed.RemoteDataset` payloads.
"""

from .folder import IMG_EXTENSIONS, FileDataset, ImageFolder, decode_rgb
from .shards import ShardReader, Shards, lines, shard_order
from .storage import is_transient, retry

__all__ = [
    "FileDataset",
    "IMG_EXTENSIONS",
    "ImageFolder",
    "ShardReader",
    "Shards",
    "decode_rgb",
    "is_transient",
    "lines",
    "retry",
    "shard_order",
]
