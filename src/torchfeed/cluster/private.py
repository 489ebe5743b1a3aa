"""Folders and files for Slurm jobs that no other local user can replace.

A batch script is run under the account that submits it, so whoever can change it (or the
folder it lies in, or any folder above) runs code as that user. So:

* every folder torchfeed creates for jobs is 0700, whatever the umask (:func:`private_dir`);
* an existing folder on the way (the working directory, ``./torchfeed-pools``, a given
  job directory and every folder above them) must belong to this user or root and be
  writable by nobody else, unless its sticky bit keeps others from renaming what is not
  theirs (``/tmp``): otherwise it is refused, naming the folder and the fix;
* files are created inside an open handle of their folder (``dir_fd``) with
  ``O_NOFOLLOW | O_EXCL`` under a fresh name and renamed into place (:func:`write_file`):
  a planted link is replaced, never written through, and a folder swapped after it was
  opened is never followed;
* scripts are handed to ``sbatch`` on its standard input, from memory, not by path.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from ..errors import TorchfeedError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafeFolderError(TorchfeedError):
    """A folder on the way to a job's files can be changed by another user."""


def _why_unsafe(st: os.stat_result, own: bool) -> str | None:
    """Why a folder with this status is unsafe (``own``: torchfeed keeps files in it)."""
    uid = os.geteuid()
    if st.st_uid != uid and (own or st.st_uid != 0):
        return f"it belongs to user id {st.st_uid}, not to you ({uid})"
    if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and not own):
        who = "its group" if st.st_mode & 0o020 else "every user"
        return f"{who} can write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _refuse(path: str, why: str, own: bool) -> UnsafeFolderError:
    if "belongs to" in why:
        fix = "have it removed and let torchfeed make its own, or choose a folder of your own"
    elif own:
        fix = f"make it private (chmod 700 {path!r}) or remove it"
    else:
        fix = f"remove write access for others (chmod go-w {path!r}), or choose a folder of your own"
    return UnsafeFolderError(
        f"{path} is not safe for Slurm job files: {why}, so another user could replace the batch "
        f"scripts torchfeed submits as you; {fix}"
    )


def check_parents(path: str | os.PathLike) -> None:
    """Refuse if ``path`` (an existing folder) or a folder above it can be changed by another
    user (see the module's docstring)."""
    path = os.path.abspath(path)
    parts = Path(path).parts
    for i in range(1, len(parts) + 1):
        at = os.path.join(*parts[:i])
        why = _why_unsafe(os.stat(at), own=False)
        if why is not None:
            raise _refuse(at, why, own=False)


def private_dir(path: str | os.PathLike, *, given: bool = False) -> int:
    """Open ``path`` as a private folder (0700, this user's), creating it and missing folders
    above it 0700; refuse unsafe folders on the way. Returns an open handle (``O_DIRECTORY``)
    that the caller closes. ``given``: a folder that, when it exists, is only checked as the
    folders above it (this user's or root's, writable by nobody else unless sticky), not made
    private: the working directory, a folder the user named, a shared ``torchfeed-pools``."""
    path = os.path.abspath(path)
    base, missing = path, list[str]()
    while not os.path.lexists(base):
        base, name = os.path.split(base)
        missing.insert(0, name)
    check_parents(base if missing or given else os.path.dirname(path) or "/")
    # a folder of torchfeed's own is never a link; the user's may be (its chain was checked)
    fd = os.open(base, _DIR_FLAGS if not (missing or given) else os.O_RDONLY | os.O_DIRECTORY)
    try:
        if not missing and not given:  # torchfeed's own folder exists: it must be this user's alone
            why = _why_unsafe(os.fstat(fd), own=True)
            if why is not None:
                raise _refuse(path, why, own=True)
            os.fchmod(fd, 0o700)
        for name in missing:
            fd = _sub(fd, name, os.path.join(base, name))
            base = os.path.join(base, name)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _sub(parent: int, name: str, shown: str) -> int:
    """Create (or open, when it appeared meanwhile) the private folder ``name`` in ``parent``
    and return its handle; ``parent`` is closed."""
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    finally:
        os.close(parent)
    why = _why_unsafe(os.fstat(fd), own=True)
    if why is not None:
        os.close(fd)
        raise _refuse(shown, why, own=True)
    os.fchmod(fd, 0o700)  # mkdir's mode went through the umask
    return fd


def new_private_dir(parent: int, prefix: str) -> tuple[int, str]:
    """A new private folder ``prefix`` + random in the folder ``parent``: (handle, name)."""
    for _ in range(100):
        name = prefix + secrets.token_hex(4)
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            continue
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        os.fchmod(fd, 0o700)
        return fd, name
    raise TorchfeedError(f"could not create a new folder {prefix}* (100 names taken)")


def sub_dir(parent: int, name: str) -> None:
    """The private folder ``name`` inside the open folder ``parent`` (created when missing)."""
    os.close(_sub(os.dup(parent), name, name))


def write_file(folder: int, name: str, text: str, mode: int = 0o600) -> None:
    """Write ``name`` in the open folder ``folder``: created under a fresh name with
    O_EXCL | O_NOFOLLOW, then renamed over whatever had that name (a link is replaced, never
    followed)."""
    temporary = f".{name}.{secrets.token_hex(4)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=folder)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
        os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        try:
            os.unlink(temporary, dir_fd=folder)
        except OSError:
            pass
        raise
