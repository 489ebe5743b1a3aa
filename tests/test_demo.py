"""``torchfeed demo`` end to end: local workers feed a CNN that learns the digits."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchfeed
import torchfeed.plots

pytest.importorskip("sklearn")

from torchfeed.tools.demo import AugmentedDigits, load_digits_split, normalize, random_affine  # noqa: E402


def _rate(pattern: str, text: str) -> float:
    match = re.search(pattern + r".*?([\d,]+) samples/s", text)
    assert match, f"no line matching {pattern!r} in the demo's output:\n{text}"
    return float(match.group(1).replace(",", ""))


@pytest.mark.slow
@pytest.mark.timeout(360)  # bounds a hang, not the speed: a busy machine stretches the demo
def test_demo_trains_and_compares_loaders(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    png = tmp_path / "demo.png"
    proc = subprocess.run(
        [sys.executable, "-m", "torchfeed", "demo", "--epochs", "2", "--plot", str(png)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"demo exited with {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr}"
    assert re.search(r"workers: 127\.0\.0\.1:\d+, 127\.0\.0\.1:\d+", out), out
    assert len(re.findall(r"^epoch [12]/2 ", out, re.MULTILINE)) == 2, out
    match = re.search(r"test accuracy: ([\d.]+)%", out)
    assert match, out
    assert float(match.group(1)) > 50.0, out
    assert _rate(r"torchfeed\.RemoteDataLoader", out) > 0
    assert _rate(r"torch DataLoader\(num_workers=2\)", out) > 0
    assert re.search(r"ratio torchfeed / torch\s+[\d.]+x", out), out
    # the stats table and the advice end the training
    assert re.search(r"^worker\s+state\s+samples/s", out, re.MULTILINE), out
    assert re.search(r"^(input-bound|not input-bound)", out, re.MULTILINE), out
    if torchfeed.plots.available():
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_augmentation_follows_the_loader_seed(workers2):
    train_x, train_y, test_x, test_y = load_digits_split(0)
    assert (len(train_y), len(test_y)) == (1497, 300)
    assert np.array_equal(load_digits_split(0)[3], test_y)  # the split is deterministic
    ds = AugmentedDigits(train_x, train_y)
    x, y = ds[5]
    assert x.shape == (1, 8, 8) and str(x.dtype) == "torch.float32" and y == int(train_y[5])
    plain = AugmentedDigits(test_x, test_y, augment=False)
    assert np.allclose(plain[7][0].numpy()[0], normalize(test_x[7] / 16.0))
    # on workers, the loader's seed makes the augmentation exact; epochs differ
    remote = torchfeed.RemoteDataset(workers2, AugmentedDigits, train_x[:64], train_y[:64])
    one = torchfeed.RemoteDataLoader(remote, batch_size=16, seed=3)
    first, second = torch.cat([b[0] for b in one]), torch.cat([b[0] for b in one])
    again = torch.cat([b[0] for b in torchfeed.RemoteDataLoader(remote, batch_size=16, seed=3)])
    assert torch.equal(first, again) and not torch.equal(first, second)


class _Draws:
    """Stands in for a numpy Generator: random() returns fixed values (mapped to [-1, 1))."""

    def __init__(self, *u):
        self.u = np.asarray(u, dtype=float)

    def random(self, n):
        return (self.u[:n] + 1) / 2


def test_random_affine_geometry():
    image = np.random.default_rng(1).random((8, 8))
    assert np.allclose(random_affine(image, _Draws(0, 0, 0, 0)), image)  # identity
    down = random_affine(image, _Draws(0, 0, 1, 0))  # one pixel down
    assert np.allclose(down[1:], image[:-1]) and np.allclose(down[0], 0)
    left = random_affine(image, _Draws(0, 0, 0, -1))  # one pixel left
    assert np.allclose(left[:, :-1], image[:, 1:]) and np.allclose(left[:, -1], 0)
    quarter = random_affine(image, _Draws(1, 0, 0, 0), max_degrees=90)  # a quarter turn
    assert np.allclose(quarter, np.rot90(image)) or np.allclose(quarter, np.rot90(image, -1))


def test_the_demo_says_when_the_machine_is_busy():
    from torchfeed.tools.demo import busy_note

    assert busy_note(load=0.5, cores=2) is None
    note = busy_note(load=7.9, cores=2)
    assert note is not None and "busy" in note and "7.9" in note
