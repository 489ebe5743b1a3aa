"""Deprecated: the Ray pool lives in :mod:`torchfeed.ray.pool` (``torchfeed.ray.Pool``); the old
names here warn once (:data:`torchfeed.deprecation.MOVED_MODULES`)."""

from __future__ import annotations

from ..deprecation import moved_module

__getattr__ = moved_module(__name__)
