"""The ``torchfeed`` command: ``torchfeed worker | demo | bench | top | slurm``.

Parsing (and ``--help``, ``--version``) imports no torch: it answers at once. The
``--help`` text is written for a terminal (no reStructuredText markup): the list of
commands in it is made from the subcommands themselves.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Protocol, cast

from .. import __version__

# The subcommands, in --help order: each is the module torchfeed.cli.NAME, with HELP (one
# line), DESCRIPTION (its --help text), add_arguments(parser) and run(args) -> exit status.
# Building the parser imports them all, so none imports torch before run().
COMMANDS = ("worker", "demo", "bench", "top", "slurm")


class Parser(argparse.ArgumentParser):
    """Usage errors in one line (no usage block, no traceback)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="torchfeed")
    parser.add_argument("--version", action="version", version=f"torchfeed {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        command = _command(name)
        command.add_arguments(sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION))
    parser.description = (
        f"Feed PyTorch training from remote data-loading workers. Commands: {', '.join(COMMANDS)} "
        "(torchfeed COMMAND --help for each)."
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _command(args.command).run(args)


class Command(Protocol):
    """What a subcommand's module holds."""

    HELP: str
    DESCRIPTION: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _command(name: str) -> Command:
    return cast(Command, importlib.import_module(f"{__name__}.{name}"))


if __name__ == "__main__":
    sys.exit(main())
