"""fsspec plumbing shared by the datasets: URLs to filesystems, one listing, retried reads.

Every dataset keeps the URL and ``storage_options`` it was given and opens its
filesystem lazily in the process that reads (and again after a fork), so instances can
be pickled to DataLoader workers, sent to torchfeed workers, or built there.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_RETRIES = 3
DEFAULT_BACKOFF = 0.2  # seconds before the first retry; doubled each time

# errno values of failures that may go away when tried again
_TRANSIENT_ERRNOS = {
    errno.EAGAIN,
    errno.EBUSY,
    errno.EIO,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.ENETDOWN,
    errno.ENETUNREACH,
    errno.EHOSTUNREACH,
    getattr(errno, "EREMOTEIO", errno.EIO),
}
# failures that retrying cannot fix
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
# client libraries whose connection and timeout errors do not derive from the builtin ones
_CLIENT_MODULES = ("aiohttp", "botocore", "urllib3", "requests", "http.client", "google", "azure", "fsspec")
_CLIENT_WORDS = (
    "connection",
    "timeout",
    "disconnect",
    "payload",
    "incompleteread",
    "throttl",
    "slowdown",
    "unavailable",
    "reset",
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a storage failure that may succeed when retried.

    Connection drops, timeouts, throttling (S3 ``SlowDown``, HTTP 503) and server errors
    are transient; missing files, permission errors and bad arguments are not.
    """
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    for cls in type(exc).__mro__:
        module = cls.__module__ or ""
        if module.startswith(_CLIENT_MODULES) and any(w in cls.__name__.lower() for w in _CLIENT_WORDS):
            return True
    return False


def retry(
    fn: Callable[[], T], what: str, retries: int = DEFAULT_RETRIES, backoff: float = DEFAULT_BACKOFF
) -> T:
    """Call ``fn()``; on a transient error try again up to ``retries`` times, backing off.

    The last error is re-raised with a note naming ``what`` and the attempts made.
    """
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            if attempt >= retries or not is_transient(exc):
                if attempt and hasattr(exc, "add_note"):  # Python >= 3.11
                    exc.add_note(f"while {what}: gave up after {attempt + 1} attempts")
                raise
            delay = backoff * (2**attempt) * (0.5 + random.random())
            attempt += 1
            time.sleep(delay)


def open_url(url: str, storage_options: dict[str, Any] | None = None):
    """``(filesystem, path)`` for an fsspec URL or a local path."""
    try:
        import fsspec.core
    except ImportError:  # pragma: no cover - fsspec comes with the extra
        raise ImportError(
            "torchfeed.datasets needs fsspec: pip install 'torchfeed[dask]' "
            "(or fsspec plus the filesystem you use, e.g. s3fs)"
        ) from None
    fs, path = fsspec.core.url_to_fs(os.fspath(url), **(storage_options or {}))
    return fs, path.rstrip("/") or path


class FileSystemUser:
    """Mixin: a filesystem opened lazily per process from ``self.url``/``self.storage_options``."""

    url: str
    storage_options: dict[str, Any]

    def _init_fs(self, url: str, storage_options: dict[str, Any] | None, retries: int) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise TypeError(
                f"url must be a string such as 's3://bucket/prefix' or a local path, not {type(url).__name__}"
            )
        self.url = os.fspath(url)
        self.storage_options = dict(storage_options or {})
        self.retries = int(retries)
        self._fs = None
        self._fs_pid = -1
        fs, self._root = open_url(self.url, self.storage_options)
        self._keep_fs(fs)

    def _keep_fs(self, fs) -> None:
        self._fs, self._fs_pid = fs, os.getpid()

    @property
    def fs(self):
        """The filesystem, (re)opened in the calling process."""
        if self._fs is None or self._fs_pid != os.getpid():
            self._keep_fs(open_url(self.url, self.storage_options)[0])
        return self._fs

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fs"], state["_fs_pid"] = None, -1  # never ship a live client (sockets, loops)
        return state

    def read_bytes(self, path: str) -> bytes:
        """The whole content of ``path`` (one request), retried on transient errors."""
        return retry(lambda: self.fs.cat_file(path), f"reading {path}", self.retries)

    def _list_files(self, what: str) -> tuple[list[str], list[str]]:
        """One recursive listing under the root: (relative file paths, relative directory paths)."""
        fs, root = self.fs, self._root

        def listing():
            fs.invalidate_cache(root)
            return fs.find(root, withdirs=True, detail=True)

        try:
            entries = retry(listing, f"listing {self.url}", self.retries)
        except FileNotFoundError:
            entries = {}
        files, dirs = [], set()
        prefix = root.rstrip("/") + "/"
        for path, info in entries.items():
            path = path.rstrip("/")
            if path == root.rstrip("/"):
                if info.get("type") == "file":
                    raise NotADirectoryError(
                        f"{what}: {self.url} is a file; give the URL of the directory "
                        "(prefix) that holds the data"
                    )
                continue
            if not path.startswith(prefix):
                continue
            rel = path[len(prefix) :]
            if info.get("type") == "directory":
                dirs.add(rel)
            else:
                files.append(rel)
                parent = rel.rpartition("/")[0]
                while parent:  # object stores have no directory entries: infer them
                    dirs.add(parent)
                    parent = parent.rpartition("/")[0]
        if not files and not dirs:
            raise FileNotFoundError(
                f"{what}: nothing found under {self.url!r}: the path does not exist or is empty. Check the "
                "bucket and prefix, and storage_options (endpoint_url, credentials) for object stores"
            )
        return files, sorted(dirs)

    def _full(self, rel: str) -> str:
        return f"{self._root.rstrip('/')}/{rel}"


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a glob over ``/``-separated relative paths.

    ``*`` and ``?`` stay within one path segment, ``**`` matches any number of segments
    (``**/*.json`` also matches ``a.json``), ``[abc]`` is a character class.
    """
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] in ("!", "]") else i + 1)
            if j < 0:
                out.append(re.escape(c))
                i += 1
            else:
                body = pattern[i + 1 : j]
                body = "^" + body[1:] if body.startswith("!") else body
                out.append(f"[{body.replace(chr(92), chr(92) * 2)}]")
                i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL)
