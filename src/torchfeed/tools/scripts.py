"""What the benchmark scripts (``benchmarks/*.py``) share around the cases they run:
the secret of their local workers and how they hand back a result."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from typing import Any


def throwaway_secret() -> None:
    """The trainer and its local workers share a secret: a random one unless the user set their own."""
    os.environ.setdefault("TORCHFEED_SECRET", secrets.token_hex(32))


def write_json(result: Any, path: str | None) -> None:
    """``result`` as indented JSON in ``path``; nothing where no path is given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def report(lines: Iterable[str], result: Any, json_path: str | None) -> None:
    """Print a result's lines for a person, then write its numbers (:func:`write_json`)."""
    for line in lines:
        print(line)
    write_json(result, json_path)
