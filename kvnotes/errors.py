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


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process was (:func:`terminate_as_interrupt`): every path that cleans
    up after Ctrl-C (no record, no lock file, no empty folder) cleans up after ``kill`` too."""


#: Exit status of a command stopped by SIGTERM (128 + 15).
STATUS_TERMINATED = 143


def terminate_as_interrupt() -> None:
    """Make SIGTERM raise :class:`Terminated` (a ``KeyboardInterrupt``) in the main thread, so a
    ``kill``, a batch system's time limit or a container stop leaves what Ctrl-C leaves. Does nothing
    outside the main thread (signal handlers can only be set there)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def _raise(signum, frame):
        raise Terminated()

    signal.signal(signal.SIGTERM, _raise)


def stop_message(exc: KeyboardInterrupt) -> tuple[str, int]:
    """The one line and exit status of an interrupted command: ``("interrupted", 130)`` for Ctrl-C,
    ``("terminated", 143)`` for SIGTERM (:class:`Terminated`)."""
    return ("terminated", STATUS_TERMINATED) if isinstance(exc, Terminated) else ("interrupted", 130)
