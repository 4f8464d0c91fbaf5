"""The error scenario files raise: bad YAML, a schema violation, an empty selection.

``scenarios`` is data plus the code that validates and renders it; it imports nothing from
``kvnotes`` (``kvnotes.harness.pairs`` imports ``scenarios``, never the reverse). ``run.py`` reports a
:class:`ScenarioError` like a :class:`kvnotes.errors.KvnotesError`: one line, exit status 2.
"""


class ScenarioError(ValueError):
    """An invalid scenario file or selection; the message names the file and the key at fault."""
