"""torchfeed.datasets: ImageFolder and FileDataset on local trees and on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import collections
import errno
import io
import json
import os
import pickle

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem
from PIL import Image

import torchfeed
from s3server import S3Server
from torchfeed.datasets import IMG_EXTENSIONS, FileDataset, ImageFolder, is_transient
from torchfeed.datasets.storage import glob_to_regex

# (relative path, mode, colour): a tree with the orderings torchvision's ImageFolder cares about
TREE = [
    ("b/z.jpg", "RGB", (250, 10, 10)),
    ("b/a.JPG", "L", (128,)),
    ("b/sub/c.png", "RGBA", (10, 250, 10, 128)),
    ("b/sub-x/d.jpg", "RGB", (10, 10, 250)),
    ("b/sub/deeper/e.jpeg", "RGB", (200, 200, 0)),
    ("b/notes.txt", None, None),
    ("b-x/m.jpg", "RGB", (0, 200, 200)),
    ("B/upper.png", "RGB", (90, 90, 90)),
    ("a b/space.jpg", "RGB", (30, 60, 90)),
    ("at-root.jpg", "RGB", (1, 2, 3)),
]


def make_tree(root: str, tree=TREE) -> None:
    for rel, mode, colour in tree:
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if mode is None:
            with open(path, "w") as f:
                f.write("not an image")
            continue
        img = Image.new(mode, (8, 6), colour)
        img.save(path, format="PNG" if rel.endswith(".png") else "JPEG")


def torchvision_reference(root: str):
    """What torchvision.datasets.ImageFolder finds (its documented algorithm, on the local tree)."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    class_to_idx = {c: i for i, c in enumerate(classes)}
    samples = []
    for c in sorted(class_to_idx):
        for dirpath, _, names in sorted(os.walk(os.path.join(root, c), followlinks=True)):
            for name in sorted(names):
                path = os.path.join(dirpath, name)
                if path.lower().endswith(IMG_EXTENSIONS):
                    samples.append((path, class_to_idx[c]))
    return classes, class_to_idx, samples


def to_tensor(img) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)


@pytest.fixture
def tree(tmp_path):
    root = str(tmp_path / "images")
    make_tree(root)
    return root


def test_imagefolder_matches_torchvision(tree):
    classes, class_to_idx, samples = torchvision_reference(tree)
    ds = ImageFolder(tree, transform=None, target_transform=lambda t: t * 10)
    assert ds.classes == classes == ["B", "a b", "b", "b-x"]
    assert ds.class_to_idx == class_to_idx
    assert ds.samples == samples and ds.imgs == samples
    assert ds.targets == [t for _, t in samples]
    assert len(ds) == 8
    for i, (path, target) in enumerate(samples):
        img, t = ds[i]
        assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (8, 6)
        with Image.open(path) as ref:
            assert np.array_equal(np.asarray(img), np.asarray(ref.convert("RGB")))
        assert t == target * 10
    # file:// URLs and trailing slashes name the same tree
    assert ImageFolder("file://" + tree + "/").samples == samples
    assert "Number of datapoints: 8" in repr(ds)


def test_imagefolder_is_valid_file_and_transform(tree):
    ds = ImageFolder(tree, transform=to_tensor, is_valid_file=lambda p: p.endswith(".png"), allow_empty=True)
    assert [os.path.basename(p) for p, _ in ds.samples] == ["upper.png", "c.png"]
    x, y = ds[1]
    assert x.shape == (3, 6, 8) and x.dtype == torch.uint8 and y == ds.class_to_idx["b"]


def test_imagefolder_errors(tmp_path, tree):
    with pytest.raises(FileNotFoundError, match="does not exist or is empty"):
        ImageFolder(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="does not exist or is empty"):
        ImageFolder(str(tmp_path / "empty"))
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "x.jpg").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder"):
        ImageFolder(str(flat))
    os.makedirs(os.path.join(tree, "zz-empty", "deep"))
    with pytest.raises(FileNotFoundError, match="no valid file for the classes zz-empty"):
        ImageFolder(tree)
    assert "zz-empty" in ImageFolder(tree, allow_empty=True).classes
    with pytest.raises(NotADirectoryError, match="is a file"):
        ImageFolder(os.path.join(tree, "b", "z.jpg"))
    with pytest.raises(TypeError, match="url must be"):
        ImageFolder(42)  # type: ignore[arg-type]  # not a url: refused
    broken = tmp_path / "broken" / "c"
    broken.mkdir(parents=True)
    (broken / "bad.jpg").write_bytes(b"definitely not a jpeg")
    with pytest.raises(Exception, match="cannot identify image") as info:
        ImageFolder(str(tmp_path / "broken"))[0]
    if hasattr(info.value, "__notes__"):
        assert "bad.jpg" in info.value.__notes__[0]


def test_imagefolder_pickles_and_works_in_dataloader_workers(tree):
    ds = ImageFolder(tree, transform=to_tensor)
    _ = ds.fs  # a live filesystem must not travel
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._fs is None and clone.samples == ds.samples
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="fork")
    expected = torch.utils.data.DataLoader(ds, batch_size=4)
    for (x, y), (ex, ey) in zip(loader, expected, strict=True):
        assert torch.equal(x, ex) and torch.equal(y, ey)


def test_filedataset_pattern_and_decode(tmp_path):
    root = tmp_path / "records"
    for rel in ["a.json", "x/b.json", "x/y/c.json", "x/skip.txt", "z.JSON"]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("plain text" if rel.endswith(".txt") else json.dumps({"name": rel}))
    everything = FileDataset(str(root), "**/*.json", json.loads)
    assert [d["name"] for d in iter(everything)] == ["a.json", "x/b.json", "x/y/c.json"]
    assert everything.files[0] == str(root / "a.json")
    assert [d["name"] for d in iter(FileDataset("file://" + str(root), "*.json", json.loads))] == ["a.json"]
    assert FileDataset(str(root), "x/*")[1] == b"plain text"  # raw bytes without decode
    assert len(FileDataset(str(root))) == 5
    with pytest.raises(FileNotFoundError, match=r"no file under .* matches '\*\.csv' \(5 files there"):
        FileDataset(str(root), "*.csv")
    with pytest.raises(ValueError, match="pattern must be"):
        FileDataset(str(root), "")
    bad = FileDataset(str(root), "x/skip.txt", json.loads)
    with pytest.raises(json.JSONDecodeError) as info:
        bad[0]
    if hasattr(info.value, "__notes__"):
        assert "skip.txt" in info.value.__notes__[0]


@pytest.mark.parametrize(
    "pattern, matches, misses",
    [
        ("*.jpg", ["a.jpg", ".h.jpg"], ["d/a.jpg", "a.jpeg"]),
        ("**/*.jpg", ["a.jpg", "d/a.jpg", "d/e/a.jpg"], ["a.png", "d/a.jpgx"]),
        ("d/**", ["d/a", "d/e/f"], ["e/a", "da"]),
        ("img?.[pj]ng", ["img1.png", "img2.jng"], ["img10.png", "img1.gng"]),
        ("[!a]*.txt", ["b.txt"], ["a.txt"]),
        ("a+b(1).txt", ["a+b(1).txt"], ["aab1.txt"]),
    ],
)
def test_glob_to_regex(pattern, matches, misses):
    regex = glob_to_regex(pattern)
    assert all(regex.match(m) for m in matches)
    assert not any(regex.match(m) for m in misses)


class FlakyFS(LocalFileSystem):
    """The local filesystem, with injected transient failures on chosen reads."""

    protocol = "flakytest"
    failures: dict = {}
    calls: collections.Counter = collections.Counter()

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("flakytest://"):
            path = path[len("flakytest://") :]
        return super()._strip_protocol(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        path = self._strip_protocol(path)
        FlakyFS.calls[path] += 1
        if FlakyFS.failures.get(path, 0) > 0:
            FlakyFS.failures[path] -= 1
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer (injected)")
        return super().cat_file(path, start, end, **kwargs)


def test_transient_errors_are_retried(tree):
    fsspec.register_implementation("flakytest", FlakyFS, clobber=True)
    ds = ImageFolder("flakytest://" + tree, retries=2)
    first = os.path.join(tree, "B", "upper.png")
    FlakyFS.calls.clear()
    FlakyFS.failures = {first: 2}
    img, _ = ds[0]  # two resets, then success
    assert img.size == (8, 6) and FlakyFS.calls[first] == 3
    FlakyFS.failures = {first: 5}
    with pytest.raises(ConnectionResetError) as info:
        ds[0]
    assert FlakyFS.calls[first] == 6  # 3 + one try and two retries
    if hasattr(info.value, "__notes__"):
        assert "gave up after 3 attempts" in info.value.__notes__[0]
    gone = os.path.join(tree, "b", "z.jpg")
    index = [p.endswith("b/z.jpg") for p, _ in ds.samples].index(True)
    os.unlink(gone)
    with pytest.raises(FileNotFoundError):
        ds[index]
    assert FlakyFS.calls[gone] == 1  # a missing file is not retried


def test_is_transient():
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert is_transient(OSError(errno.EBUSY, "SlowDown"))  # s3fs's translation of S3 throttling
    assert not is_transient(FileNotFoundError(errno.ENOENT, "gone"))
    assert not is_transient(PermissionError(errno.EACCES, "denied"))
    assert not is_transient(ValueError("bad"))
    assert not is_transient(OSError(errno.EINVAL, "InvalidArgument"))


# --------------------------------------------------------------------------- real S3 (SeaweedFS)


@pytest.fixture(scope="module")
def s3():
    return S3Server.shared()


@pytest.fixture
def s3_tree(s3, tree):
    prefix = s3.new_prefix()
    s3.filesystem().put(tree + "/", f"{prefix}/train/", recursive=True)
    return f"s3://{prefix}/train", tree


@pytest.mark.slow
def test_imagefolder_over_s3(s3, s3_tree):
    url, local_root = s3_tree
    ds = ImageFolder(url, storage_options=s3.storage_options)
    local = ImageFolder(local_root)
    assert ds.classes == local.classes and ds.class_to_idx == local.class_to_idx
    rel = [(p[len(url) + 1 :], t) for p, t in ds.samples]
    assert rel == [(os.path.relpath(p, local_root), t) for p, t in local.samples]
    for i in range(len(ds)):
        (img, t), (ref, rt) = ds[i], local[i]
        assert img.mode == "RGB" and np.array_equal(np.asarray(img), np.asarray(ref)) and t == rt
    # the parent's S3 client (its event loop thread) does not survive a fork: the child opens its own
    forked = torch.utils.data.DataLoader(
        ImageFolder(url, transform=to_tensor, storage_options=s3.storage_options),
        batch_size=8,
        num_workers=1,
        multiprocessing_context="fork",
    )
    [(x, y)] = list(forked)
    assert torch.equal(x[0], to_tensor(local[0][0])) and y.tolist() == local.targets
    records = FileDataset(url, "b/**/*.jp*g", storage_options=s3.storage_options)
    assert [f[len(url) + 1 :] for f in records.files] == ["b/sub-x/d.jpg", "b/sub/deeper/e.jpeg", "b/z.jpg"]
    with open(os.path.join(local_root, "b", "z.jpg"), "rb") as f:
        assert records[2] == f.read()


@pytest.mark.slow
def test_s3_missing_prefix_and_bucket(s3, s3_tree):
    url, _ = s3_tree
    with pytest.raises(FileNotFoundError, match="does not exist or is empty"):
        ImageFolder(url + "-nothing-here", storage_options=s3.storage_options)
    with pytest.raises(FileNotFoundError, match="does not exist or is empty"):
        ImageFolder("s3://no-such-bucket-tf/x", storage_options=s3.storage_options)
    with pytest.raises(FileNotFoundError, match="no file under"):
        FileDataset(url, "*.parquet", storage_options=s3.storage_options)


@pytest.mark.slow
def test_imagefolder_over_s3_in_remote_workers(s3, s3_tree, workers2):
    url, _ = s3_tree
    remote = torchfeed.RemoteDataset(
        workers2, ImageFolder, url, transform=to_tensor, storage_options=s3.storage_options
    )
    local = ImageFolder(url, transform=to_tensor, storage_options=s3.storage_options)
    assert len(remote) == len(local) == 8
    got = list(torchfeed.RemoteDataLoader(remote, batch_size=3))
    want = list(torch.utils.data.DataLoader(local, batch_size=3))
    assert len(got) == len(want) == 3
    for (x, y), (ex, ey) in zip(got, want):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    blobs = torchfeed.RemoteDataset(
        workers2, FileDataset, url, "**/*.png", storage_options=s3.storage_options
    )
    png = blobs[0]
    with Image.open(io.BytesIO(png)) as img:
        assert img.size == (8, 6)
