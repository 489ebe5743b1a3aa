"""``python -m torchfeed.launch --host H --port P``: the seed project's worker command."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
