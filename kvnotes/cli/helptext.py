"""Command-line help in plain text: the commands' descriptions are their module docstrings, written
for the API docs in reStructuredText (``:func:`kvnotes.x.y```, ````literal````, ``**bold**``);
:class:`PlainHelpFormatter` shows them without that markup, keeping the docstring's own line
layout, and every ``kvnotes`` parser uses it (``tests/cli/test_cli_help.py``)."""

from __future__ import annotations

import argparse
import re

_ROLE = re.compile(r":(?:func|mod|class|data|meth|attr|obj|exc):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")


def plain(text: str) -> str:
    """``text`` without reStructuredText roles, literal markup and bold: ``:func:`a.b``` -> ``a.b``,
    ````x```` -> ``x``, ``**x**`` -> ``x``."""
    return _BOLD.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text)))


class PlainHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``argparse`` help with the description's lines kept as written and every text made
    :func:`plain` (the description, the epilog and each flag's help)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))
