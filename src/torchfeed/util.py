"""Small operating-system helpers used across the layers (no torch, no other torchfeed module).

One home for idioms that were written several times: a free TCP port, closing a socket other
threads block on, whether a host is loopback, whether a process is alive, an atomic file
write, a doubling backoff, the CPUs this process may use, saving and restoring environment
variables, and a callback that holds its object weakly.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, BinaryIO

__all__ = [
    "atomic_write",
    "cpu_count",
    "double_delay",
    "env_int",
    "env_seconds",
    "free_port",
    "fsync_dir",
    "hard_close",
    "is_loopback_host",
    "pid_alive",
    "restore_env",
    "saved_env",
    "umask",
    "weak_callback",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on now (the OS picks it; another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def hard_close(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways, which wakes a thread blocked on it (close alone would not),
    then close it; a socket already shut down or never connected is closed all the same."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an IP, bracketed or with a zone, or ``localhost``) is a loopback address,
    an IPv4-mapped IPv6 one included. Other names are not resolved: a name means a network."""
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited; a zombie (exited, not reaped) is dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux), or it went away meanwhile: the signal check stands


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one), at least 1."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def double_delay(previous: float, first: float, most: float) -> float:
    """The next delay of an exponential backoff: ``first`` after 0, then twice the last, at most ``most``."""
    return min(max(previous * 2, first), most)


def umask() -> int:
    """This process's file-mode creation mask, read without changing it (0o022 where unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a rename in it) to disk; best effort."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike[str],
    content: bytes | Callable[[BinaryIO], object],
    temp_prefix: str | None = None,
) -> None:
    """Write a file so that readers see either the old file or the whole new one, never a part.

    ``content`` is the bytes, or a function writing them to the open file. They go to a
    temporary file in the same directory (named ``temp_prefix`` + pid + random, default
    ``.NAME.tmp-``), are flushed to disk, and the file is renamed over ``path``. The new file
    gets the usual mode (0666 less the umask); the temporary file is removed on any failure.
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    prefix = temp_prefix if temp_prefix is not None else f".{name}.tmp-"
    tmp = os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 & ~umask())
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(content, (bytes, bytearray, memoryview)):
                f.write(content)
            else:
                content(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def restore_env(saved: Mapping[str, str | None]) -> None:
    """Put environment variables back as ``saved`` has them (``None``: the variable was unset)."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextlib.contextmanager
def saved_env(names: Iterable[str]) -> Iterator[dict[str, str | None]]:
    """Within the block, change the named environment variables freely; they are restored after."""
    saved = {key: os.environ.get(key) for key in names}
    try:
        yield saved
    finally:
        restore_env(saved)


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` that imports ``name`` from its module ``exports[name]`` (relative
    to ``package``) on first use and keeps it as a plain attribute: importing the package stays
    light (``torchfeed --help`` imports no torch)."""
    import importlib
    import sys

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)  # later lookups are plain attribute reads
        return value

    return __getattr__


# -- settings from the environment: read when used, and a bad value named in the error --------
def is_count(value: Any, low: int = 0, high: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool) in ``[low, high]``: a count read from a file or
    a peer (a checkpoint, a state) before it is used."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= low
        and (high is None or value <= high)
    )


def env_int(name: str, default: int, low: int, high: int | None = None) -> int:
    """The integer in environment variable ``name`` (``default`` when unset or empty); ValueError
    names the variable, what it holds and what is allowed."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer: it must be {allowed}, or unset") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}={value} is out of range: it must be {allowed}, or unset")
    return value


def env_seconds(name: str, default: float) -> float:
    """The seconds in environment variable ``name`` (``default`` when unset or empty); ValueError
    names the variable and what to write."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds: set it to e.g. {default:g}") from None


def weak_callback(method: Callable[..., Any], *args: Any) -> Callable[..., None]:
    """A callback that calls the bound ``method`` with ``args`` and then its own arguments, while
    ``method``'s object lives: it holds that object weakly (a reply still pending keeps nothing
    alive), and does nothing once the object is gone."""
    ref = weakref.WeakMethod(method)

    def callback(*more: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, *more)

    return callback
