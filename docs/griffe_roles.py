"""Griffe extensions for the API reference: Sphinx roles in docstrings become code spans.

The docstrings use roles such as :class:`RemoteDataset` and :meth:`~Preemption.requeue`,
which Markdown would show literally. This turns each into `RemoteDataset` (a leading ``~``
keeps the last dotted part, as in Sphinx) when the docs are built; the sources stay as
they are. Configured in mkdocs.yml (``extensions`` of the python handler).

It also splits grouped numpy-style parameters (``secret, secret_file : ...``) into one entry
per name without the shared type, so each is shown with its own type and default from the
signature (griffe gives every name of a group the first one's).

``DefaultSessionFunctions`` shows a torchfeed.client function made from a Session method
(``rpc_async``) with that method's signature and docstring.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

GROUP = re.compile(r"^(?P<indent>\s*)(?P<names>\w+(?:\s*,\s*\w+)+)\s*(?::.*)?$")
PARAMETER_SECTIONS = ("Parameters", "Other Parameters")
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(?P<target>[^`]+)`")


def _code(match: re.Match) -> str:
    target = match["target"]
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target}`"


def split_groups(text: str) -> str:
    """``a, b : T`` + description in a Parameters section -> ``a`` and ``b``, each with it."""
    lines = text.splitlines()
    out: list[str] = []
    section = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and set(lines[i + 1].strip()) == {"-"} and line.strip():
            section = line.strip()
        match = GROUP.match(line) if section in PARAMETER_SECTIONS else None
        if match is None:
            out.append(line)
            i += 1
            continue
        indent = match["indent"]
        body = []
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i])
            i += 1
        trailing = []
        while body and not body[-1].strip():
            trailing.append(body.pop())
        for name in (n.strip() for n in match["names"].split(",")):
            out.extend([indent + name, *body])
        out.extend(trailing)
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_groups(ROLE.sub(_code, obj.docstring.value))


class DefaultSessionFunctions(griffe.Extension):
    """A module function of torchfeed.client made from a Session method
    (``rpc_async = _on_default_session(Session.rpc_async)``) is shown as the function it is at
    run time: the method's signature less ``self`` and its docstring. Read from the source, it
    would be an attribute."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "torchfeed":
            return
        client = pkg["client"]
        for name, member in list(client.members.items()):
            if member.is_alias or not member.is_attribute:
                continue
            value = member.value
            if not (isinstance(value, griffe.ExprCall) and str(value.function) == "_on_default_session"):
                continue
            method = client[str(value.arguments[0])]
            docstring = method.docstring
            function = griffe.Function(
                name,
                parameters=griffe.Parameters(*list(method.parameters)[1:]),
                returns=method.returns,
                lineno=member.lineno,
                endlineno=member.endlineno,
                docstring=docstring
                and griffe.Docstring(
                    docstring.value,
                    lineno=docstring.lineno,
                    endlineno=docstring.endlineno,
                    parser=docstring.parser,
                    parser_options=docstring.parser_options,
                ),
            )
            client.set_member(name, function)
