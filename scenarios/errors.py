"""The error scenario files raise: bad YAML, a schema violation, an empty selection.

``scenarios`` is data plus the code that validates and renders it; it imports nothing from
``kvnotes`` (``kvnotes.harness.pairs`` imports ``scenarios``, never the reverse). ``run.py`` reports a
:class:`ScenarioError` like a :class:`kvnotes.errors.KvnotesError`: one line, exit status 2.
"""

#: Characters ``str.splitlines`` breaks a line at; a message shows them escaped (``\\n``), so a key or a
#: value quoted from a file (``"a\nb"``) never splits it.
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
_ESCAPES = {ord(c): repr(c)[1:-1] for c in _LINE_BREAKS}


def one_line(text: object) -> str:
    """``text`` with its line breaks escaped (``\\n``, ``\\x85``, ...): one line, nothing dropped."""
    return str(text).translate(_ESCAPES)


class ScenarioError(ValueError):
    """An invalid scenario file or selection; the message names the file and the key at fault, in one
    line (line breaks quoted from the file are escaped)."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(one_line(message), *args)
