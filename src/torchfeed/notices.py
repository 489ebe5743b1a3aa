"""Warnings that point at the user's line, wherever torchfeed notices the problem.

``warn`` attributes a warning to the first frame of the current stack that is not
torchfeed's own code (nor ``threading`` or ``contextlib``): the user's ``for`` loop or
constructor call, not a line inside the loader. Problems noticed on background threads
are queued with :class:`Pending` and emitted by the next call made from the user's thread.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from types import FrameType

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PLUMBING = (
    _PACKAGE_DIR,
    os.path.dirname(threading.__file__) + os.sep + "threading.py",
    os.path.dirname(threading.__file__) + os.sep + "contextlib.py",
)


def _is_ours(filename: str) -> bool:
    return filename.startswith(_PLUMBING)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside torchfeed."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # warnings.warn's stacklevel of our caller's frame
    while frame is not None and _is_ours(os.path.abspath(frame.f_code.co_filename)):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 1)


class Pending:
    """Warnings noticed on a background thread, waiting for the user's thread to emit them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list[tuple[str, type[Warning]]] = []

    def add(self, message: str, category: type[Warning] = UserWarning) -> None:
        with self._lock:
            self._items.append((message, category))

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def emit(self) -> None:
        """Emit what is queued, attributed to the first frame outside torchfeed."""
        with self._lock:
            items, self._items = self._items, []
        for message, category in items:
            warn(message, category)
