"""A griffe extension for the API reference: Sphinx roles in docstrings become code spans.

The docstrings use roles such as :class:`RemoteDataset` and :meth:`~Preemption.requeue`,
which Markdown would show literally. This turns each into `RemoteDataset` (a leading ``~``
keeps the last dotted part, as in Sphinx) when the docs are built; the sources stay as
they are. Configured in mkdocs.yml (``extensions`` of the python handler).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(?P<target>[^`]+)`")


def _code(match: re.Match) -> str:
    target = match["target"]
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
