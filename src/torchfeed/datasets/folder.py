"""Map-style datasets over any fsspec URL: ImageFolder and FileDataset."""

from __future__ import annotations

import io
import posixpath
from collections.abc import Callable
from typing import Any

import torch.utils.data

from .storage import DEFAULT_RETRIES, FileSystemUser, glob_to_regex

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def _annotate(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


def decode_rgb(data: bytes):
    """Decode image bytes with Pillow and convert to RGB (torchvision's ``pil_loader``)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


class ImageFolder(FileSystemUser, torch.utils.data.Dataset):
    """torchvision's ``ImageFolder`` over any fsspec URL (``s3://bucket/prefix``, ``file://...``, a path).

    The directories directly under ``url`` are the classes; every image file below a class
    directory (at any depth) is a sample of that class. ``classes``, ``class_to_idx``,
    ``samples`` and ``targets`` come in the same order as torchvision's, and items are
    ``(PIL RGB image, class index)`` before the transforms, as there.

    The tree is listed once, at construction (one recursive listing). Each item is read
    with its own request, nothing stays open between reads, and the filesystem client is
    reopened in each process, so the dataset is safe in DataLoader worker processes and
    as a :class:`torchfeed.RemoteDataset` payload. Transient storage errors (dropped
    connections, timeouts, throttling) are retried with backoff.

    Parameters
    ----------
    url : str
        Root of the class directories.
    transform, target_transform : callable, optional
        Applied to the image and to the class index.
    storage_options : dict, optional
        Passed to fsspec, e.g. ``{"key": ..., "secret": ..., "client_kwargs": {"endpoint_url": ...}}``
        for an S3-compatible server.
    is_valid_file : callable, optional
        ``is_valid_file(path) -> bool`` replaces the extension check.
    allow_empty : bool
        Allow class directories without any valid file (torchvision's meaning).
    retries : int
        Retries of a transient error when listing or reading.

    Raises
    ------
    FileNotFoundError
        Nothing under ``url`` (missing or empty prefix), no class directory, or a class
        without any image (unless ``allow_empty``).
    """

    def __init__(
        self,
        url: str,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        is_valid_file: Callable[[str], bool] | None = None,
        allow_empty: bool = False,
        retries: int = DEFAULT_RETRIES,
    ):
        self._init_fs(url, storage_options, retries)
        self.root = self.url
        self.transform = transform
        self.target_transform = target_transform
        self.extensions = None if is_valid_file is not None else IMG_EXTENSIONS
        files, dirs = self._list_files("ImageFolder")
        self.classes: list[str] = sorted(d for d in dirs if "/" not in d)
        if not self.classes:
            raise FileNotFoundError(
                f"Couldn't find any class folder in {self.url}: ImageFolder expects "
                f"{self.url}/<class name>/<image files>"
            )
        self.class_to_idx: dict[str, int] = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = self._make_samples(files, is_valid_file, allow_empty)
        self.targets: list[int] = [t for _, t in self.samples]
        self.imgs = self.samples

    def _make_samples(self, files: list[str], is_valid_file, allow_empty: bool) -> list[tuple[str, int]]:
        local = _is_local(self.fs)
        found = []
        for rel in files:
            cls = rel.partition("/")[0]
            if cls not in self.class_to_idx or "/" not in rel:
                continue
            path = self._full(rel) if local else self.fs.unstrip_protocol(self._full(rel))
            ok = is_valid_file(path) if is_valid_file is not None else rel.lower().endswith(IMG_EXTENSIONS)
            if ok:
                # torchvision walks sorted(os.walk(class_dir)), sorted file names in each directory
                found.append(
                    ((cls, posixpath.dirname(rel), posixpath.basename(rel)), path, self.class_to_idx[cls])
                )
        found.sort(key=lambda item: item[0])
        empty = set(self.classes) - {key[0] for key, _, _ in found}
        if empty and not allow_empty:
            supported = ", ".join(self.extensions) if self.extensions else "those accepted by is_valid_file"
            raise FileNotFoundError(
                f"Found no valid file for the classes {', '.join(sorted(empty))} under "
                f"{self.url}. Supported extensions are: {supported}"
            )
        return [(path, target) for _, path, target in found]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        data = self.read_bytes(path)
        try:
            sample = decode_rgb(data)
        except Exception as exc:
            _annotate(exc, f"while decoding {path} (sample {index}) as an image")
            raise
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def __repr__(self) -> str:
        lines = [
            f"Dataset {type(self).__name__}",
            f"    Number of datapoints: {len(self)}",
            f"    Root location: {self.url}",
        ]
        if self.transform is not None:
            lines.append(f"    Transform: {self.transform!r}")
        return "\n".join(lines)


class FileDataset(FileSystemUser, torch.utils.data.Dataset):
    """Every file under ``url`` whose relative path matches ``pattern``, decoded by ``decode``.

    Item ``i`` is ``decode(content of files[i])`` (the raw ``bytes`` without ``decode``);
    ``files`` is sorted by path. Listing, per-read requests and retries work as in
    :class:`ImageFolder`.

    Parameters
    ----------
    url : str
        Directory (prefix) holding the files, any fsspec URL or local path.
    pattern : str
        Glob over the paths relative to ``url``: ``*`` stays within a directory, ``**``
        crosses directories (``"**/*.json"`` matches ``a.json`` and ``x/y/b.json``).
    decode : callable, optional
        ``decode(data: bytes)`` returns the sample, e.g. ``lambda b: torch.load(io.BytesIO(b))``
        or ``lambda b: json.loads(b)``.
    storage_options : dict, optional
        Passed to fsspec.
    retries : int
        Retries of a transient error when listing or reading.

    Raises
    ------
    FileNotFoundError
        Nothing under ``url``, or no file matching ``pattern``.
    """

    def __init__(
        self,
        url: str,
        pattern: str = "**",
        decode: Callable[[bytes], Any] | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        retries: int = DEFAULT_RETRIES,
    ):
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"pattern must be a non-empty glob such as '**/*.json', not {pattern!r}")
        self._init_fs(url, storage_options, retries)
        self.pattern = pattern
        self.decode = decode
        files, _ = self._list_files("FileDataset")
        regex = glob_to_regex(pattern.lstrip("/"))
        matched = sorted(rel for rel in files if regex.match(rel))
        if not matched:
            examples = ", ".join(sorted(files)[:5]) or "none"
            raise FileNotFoundError(
                f"FileDataset: no file under {self.url} matches {pattern!r} ({len(files)} "
                f"files there, e.g. {examples}). Patterns are relative to the URL; use "
                "'**/' to match in subdirectories"
            )
        local = _is_local(self.fs)
        self.files: list[str] = [
            self._full(r) if local else self.fs.unstrip_protocol(self._full(r)) for r in matched
        ]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        path = self.files[index]
        data = self.read_bytes(path)
        if self.decode is None:
            return data
        try:
            return self.decode(data)
        except Exception as exc:
            _annotate(exc, f"while decoding {path} (sample {index})")
            raise

    def __repr__(self) -> str:
        return f"FileDataset({self.url!r}, pattern={self.pattern!r}, files={len(self)})"
