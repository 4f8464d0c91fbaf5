"""The error type the command line turns into a one-line message and exit status 2.

:class:`KvnotesError` is the library's; the harness adds the scenario files' own
:class:`scenarios.errors.ScenarioError` (:data:`kvnotes.harness.runconfig.USER_ERRORS`). This module
imports nothing, so every package can raise it.
"""


class KvnotesError(Exception):
    """Bad input or an unavailable resource, reported to the user as one line.

    Raised for: unknown model/probe/scenario names, a field slot missing from its template, a model
    that is neither embedded nor available offline, scenarios whose values do not change the tokens.
    """


class ModelFitError(KvnotesError, ValueError):
    """A config value the loaded model cannot take (known only once its shape is), e.g. more layer
    bands than the model has layers: one line at the command line, a ``ValueError`` to library callers."""
