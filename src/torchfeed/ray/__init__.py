"""torchfeed on Ray: :class:`Pool`, torchfeed workers as Ray actors for :func:`torchfeed.autoscale`.

Using :class:`Pool` imports Ray (``pip install 'torchfeed[ray]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..util import lazy_exports

# imported on first use: importing torchfeed.ray does not import Ray
__getattr__ = lazy_exports(__name__, {"Pool": "pool", "RayPool": "pool"})

if TYPE_CHECKING:
    from .pool import Pool, RayPool

__all__ = ["Pool", "RayPool"]
