"""Address files: one ``host:port`` line per worker process, appended by the workers.

Workers append their address (``torchfeed worker --address-file F``, the Slurm scripts'
workers file) under an exclusive lock; ``torchfeed worker --procs N`` also takes the address of
a process that died out, under the same lock; trainers read the file. A trainer connects to
whatever the file lists, so a file that other users can write lets them point it at
their own "worker": such files are refused when read, and created private (0600).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import sys
from collections.abc import Iterator

from ..errors import TorchfeedError
from ..util import atomic_write


class UnsafeAddressFile(TorchfeedError, PermissionError):
    """An address file that users other than its owner can write."""


def check_private(path: str, fd: int) -> None:
    """Refuse a file (open as ``fd``) that other users can write, or that another user owns."""
    st = os.fstat(fd)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid not in (os.geteuid(), 0):
        raise UnsafeAddressFile(
            f"address file {path} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}, "
            f"owner uid {st.st_uid}): anyone could add the address of a fake worker to it. "
            f"Fix it with `chmod 600 {path}` (and keep it in a directory only you can write)"
        )


def read_address_file(path: str) -> list[str]:
    """The address lines of a file written by :func:`announce`: in order, no blanks or repeats.

    A missing file reads as empty; a file others can write raises :class:`UnsafeAddressFile`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UnsafeAddressFile(
            f"cannot open address file {path} ({exc}); it must be a regular file, not a symbolic link"
        ) from None
    with os.fdopen(fd) as f:
        check_private(path, fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeAddressFile(f"address file {path} is not a regular file")
        lines = [line.strip() for line in f]
    return list(dict.fromkeys(line for line in lines if line and not line.startswith("#")))


def check_folder(path: str) -> None:
    """Raise FileNotFoundError when the folder of address file ``path`` does not exist.

    Workers create the file but never its folder (:func:`why_unwritable`), so no wait can make
    it appear: a trainer says so at once, whereas a missing file may still be written."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"the workers file {path} cannot appear: its folder {directory} does not exist, and workers do not "
            "create folders. Check the path (this trainer must see the folder the workers write to), or create "
            f"the folder (mkdir -p {directory}) before starting the workers with "
            f"`torchfeed worker --address-file {path}`"
        )


def _shared_folder(directory: str) -> str | None:
    """Why another user could replace a file in ``directory`` (None: no one but its owner
    and root can), looking at it and every folder above it (one above could be renamed away):
    one is writable by its group or by others without the sticky bit (which keeps them from
    renaming or removing what they do not own), or belongs to another user."""
    here = os.path.realpath(directory)
    while True:
        try:
            st = os.stat(here)
        except OSError:
            return None  # said by the checks that follow
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable and not st.st_mode & stat.S_ISVTX:
            return (
                f"the folder {here} can be written by other users (mode {stat.S_IMODE(st.st_mode):o}): "
                "another user could replace the file with a link or a file of theirs; use a folder only "
                f"you can write (chmod go-w {here}) or one with the sticky bit, as /tmp"
            )
        if st.st_uid not in (os.geteuid(), 0):
            return f"the folder {here} belongs to another user, who could replace the file; use a folder of yours"
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def why_unwritable(path: str) -> str | None:
    """Why address lines could not be appended to ``path`` (None: they can), checked before a
    worker starts, so that a wrong ``--address-file`` is said at once, in one line."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "it is a directory; give the path of a file in it"
    shared = _shared_folder(directory)
    if shared:
        return shared
    if os.path.lexists(path):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            return f"it cannot be opened for writing ({exc.strerror or exc}); it must be a regular file you can write"
        try:
            check_private(path, fd)
        except UnsafeAddressFile as exc:
            return str(exc)
        finally:
            os.close(fd)
        return None
    if not os.path.isdir(directory):
        return f"its directory {directory} does not exist; create it first (mkdir -p {directory})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"its directory {directory} is not writable by this user; choose a directory you can write"
    return None


@contextlib.contextmanager
def _locked(path: str) -> Iterator[int]:
    """``path`` open for appending (created 0600 when missing) under its exclusive lock. The file
    is the one the path names once the lock is held: :func:`remove_lines` replaces the file under
    the old one's lock, so a writer that waited on that lock opens the path again."""
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            check_private(path, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                yield fd
                return
        finally:
            os.close(fd)  # and its lock


def append_lines(path: str, lines: list[str]) -> None:
    """Append address lines to ``path`` under an exclusive lock (created 0600 when missing)."""
    with _locked(path) as fd:
        os.write(fd, "".join(line + "\n" for line in lines).encode())
        os.fsync(fd)


def remove_lines(path: str, lines: list[str]) -> None:
    """Take address lines out of ``path`` (every copy), under its lock: readers see the file
    before or after, never a part (a new file, 0600, renamed over it)."""
    gone = {line.strip() for line in lines}
    with _locked(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            kept = [line for line in f if line.strip() not in gone]
        data = "".join(kept).encode()

        def write(f) -> None:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)

        atomic_write(path, write)


def announce(address: str, address_file: str | None = None) -> None:
    """Print ``host:port`` (one line, flushed) and append it to ``address_file`` under a lock."""
    if address_file:
        append_lines(address_file, [address])
    sys.stdout.write(address + "\n")
    sys.stdout.flush()
