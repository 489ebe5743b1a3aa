"""Large batches of any type load; a batch over a limit is a clear error, not a lost worker."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import torchfeed
from torchfeed.protocol import limits

pytestmark = pytest.mark.timeout(180)

MB5 = 5_000_000


class EncodedImages(torch.utils.data.Dataset):
    """64 samples of 5 MB of bytes (as encoded images or audio), with a label."""

    def __init__(self, n: int = 64, size: int = MB5):
        self.n = n
        self.size = size

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return bytes([i % 256]) * self.size, i


class Texts(torch.utils.data.Dataset):
    """Large strings: they travel in the pickled part of a reply."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return "t" * 300_000 + str(i)


@pytest.fixture
def restore_limits():
    before = limits.reply_limits()
    yield
    limits.set_reply_limits(before.max_meta, before.max_buffers, before.max_buffer_bytes)


@pytest.mark.slow
def test_a_batch_of_64_large_bytes_objects_loads(workers2):
    ds = torchfeed.RemoteDataset(workers2, EncodedImages)
    [(blobs, labels)] = list(torchfeed.RemoteDataLoader(ds, batch_size=64))
    assert labels.tolist() == list(range(64))
    assert len(blobs) == 64 and all(type(b) is bytes and len(b) == MB5 for b in blobs)
    assert all(b[0] == i and b[-1] == i for i, b in enumerate(blobs))


@pytest.mark.parametrize(
    "knob, dataset, batch, expected",
    [
        (
            dict(max_buffer_bytes=50_000_000),
            EncodedImages,
            16,
            r"raw buffers .* hold 76\.3 MiB \(80,000,\d+ bytes\), "
            r"over the reply limit of 47\.7 MiB .*max_buffer_bytes=",
        ),
        (
            dict(max_meta_bytes=1_000_000),
            Texts,
            4,
            r"pickled part .* is 1\.1 MiB .* over the reply limit of 976\.6 KiB "
            r"\(1,000,000 bytes\).*max_meta_bytes=",
        ),
        (
            dict(max_buffers=10),
            EncodedImages,
            16,
            r"1\d raw buffers .*over the reply limit of 10.*max_buffers=",
        ),
    ],
)
@pytest.mark.slow
def test_a_batch_over_a_limit_is_a_clear_error_and_the_worker_stays(
    workers2, restore_limits, knob, dataset, batch, expected
):
    ds = torchfeed.RemoteDataset(workers2, dataset)
    torchfeed.set_reply_limits(**knob)
    loader = torchfeed.RemoteDataLoader(ds, batch_size=batch, max_retries=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(torchfeed.FrameTooLarge, match=expected) as info:
            next(iter(loader))
    err = info.value
    assert isinstance(err, torchfeed.RemoteError) and not isinstance(err, torchfeed.PoisonSampleError)
    assert "torchfeed.set_reply_limits" in str(err) and err.indices == list(range(batch))
    assert not [c for c in caught if "lost worker" in str(c.message)]
    assert ds.lost_workers() == {} and ds.alive_workers() == workers2  # no worker death, no reconnect loop
    torchfeed.set_reply_limits(
        max_meta_bytes=limits.WIRE_MAX_META, max_buffers=1 << 20, max_buffer_bytes=1 << 36
    )
    assert len(list(torchfeed.RemoteDataLoader(ds, batch_size=batch))) == len(ds) // batch  # raised: it loads


def test_limits_are_checked():
    with pytest.raises(ValueError, match="wire format's bound"):
        torchfeed.set_reply_limits(max_meta_bytes=1 << 32)
    with pytest.raises(ValueError):
        torchfeed.set_reply_limits(max_buffer_bytes=-1)


def test_a_bad_limit_in_the_environment_is_a_clear_error_when_used_not_at_import():
    """TORCHFEED_MAX_REPLY_* are read by one parser on first use: importing torchfeed works, and
    the error names the variable, its value and what is allowed."""
    import subprocess
    import sys

    code = (
        "import torchfeed.protocol.limits as limits\n"
        "try:\n"
        "    limits.reply_limits()\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "TORCHFEED_MAX_REPLY_BUFFERS": "lots", "TORCHFEED_MAX_REPLY_BYTES": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "TORCHFEED_MAX_REPLY_BUFFERS='lots' is not an integer: it must be an integer in [0, 4294967295], or unset"
    )
