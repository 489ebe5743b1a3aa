"""torchfeed on Ray: :class:`Pool`, torchfeed workers as Ray actors for :func:`torchfeed.autoscale`.

Using :class:`Pool` imports Ray (``pip install 'torchfeed[ray]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..util import lazy_exports

# Pool lives in torchfeed.scaling (which imports this package's modules): imported on first use
__getattr__ = lazy_exports(__name__, {"Pool": ".scaling.ray_pool", "RayPool": ".scaling.ray_pool"})

if TYPE_CHECKING:
    from ..scaling.ray_pool import Pool, RayPool

__all__ = ["Pool", "RayPool"]
