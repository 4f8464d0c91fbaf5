"""The error types the command line turns into a one-line message and exit status 2:
:class:`KvnotesError`, and :class:`scenarios.errors.ScenarioError` (invalid scenario files), which
is one of them (:data:`USER_ERRORS`)."""

from scenarios.errors import ScenarioError


class KvnotesError(Exception):
    """Bad input or an unavailable resource, reported to the user as one line.

    Raised for: unknown model/probe/scenario names, a field slot missing from its template, a model
    that is neither embedded nor available offline, scenarios whose values do not change the tokens.
    """


#: Exceptions reported as ``kvnotes: error: <message>`` with exit status 2.
USER_ERRORS = (KvnotesError, ScenarioError)
