"""kvnotes: activation patching on the transformers KV cache.

Packages by role, each importing only from the ones above it in this list (``tests/lanes/test_layout.py``):

- :mod:`kvnotes.errors`: the one user-facing error type.
- :mod:`kvnotes.models`: loading (local, embedded, random-weight), prompt rendering and tokenisation,
  architecture adapters, the zoo.
- :mod:`kvnotes.kv`: the KV cache and its surgery, attention hooks, knockouts, the generated readout,
  the activation engine.
- :mod:`kvnotes.ops`: editing and composition, usable alone (no scenarios, probes or harness).
- :mod:`kvnotes.context`: the editable-context API on :mod:`kvnotes.ops` (named fields in a cached
  prompt, edit modes, the ``auto`` diagnostic).
- :mod:`kvnotes.records`: the record envelope, result schemas, tables, the HTML report.
- :mod:`kvnotes.harness`: what probes share: tokens and spans, pairs, readout, the probe kit,
  selection, statistics, the probe context and registry, the job path.
- :mod:`kvnotes.plots`, :mod:`kvnotes.serving`: figures from records; the vLLM experiment.
- :mod:`kvnotes.cli`: the ``kvnotes`` command.

The probes, circuits and scenarios install as :mod:`kvnotes.probes`, :mod:`kvnotes.circuits` and
:mod:`kvnotes.scenarios`, the configs as ``kvnotes/conf`` (package data Hydra reads): in the repository
they are the top-level folders ``probes/``, ``circuits/``, ``scenarios/`` and ``conf/``, linked into the
package, and a wheel holds them as ordinary files (``docs/guide/own-project.md``).
"""

import os
from pathlib import Path

from kvnotes.errors import KvnotesError

#: The config groups (``model``, ``probe``, ``scenario``, ...) that ship with kvnotes: the primary
#: config directory of ``kvnotes run``; a user's own configs join it with ``--config-dir``.
CONF_DIR = Path(__file__).parent / "conf"



def existing_ancestor(path: str | Path) -> Path:
    """``path`` itself when it exists, else the nearest of its parents that does (absolute, ``~``
    expanded): where an output that does not exist yet would be created, checked before any work."""
    path = Path(os.path.abspath(os.path.expanduser(str(path))))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def try_new_entry(folder: str | Path, directory: bool = False) -> None:
    """Create a hidden file (or, with ``directory``, a folder) in ``folder`` and remove it at once:
    whether an output can be made there, by trying (root passes ``os.access`` under ``/proc`` and on a
    read-only file system).

    Raises:
        OSError: it cannot be created.
    """
    import tempfile

    if directory:
        os.rmdir(tempfile.mkdtemp(prefix=".kvnotes-write-test-", dir=folder))
    else:
        fd, name = tempfile.mkstemp(prefix=".kvnotes-write-test-", dir=folder)
        os.close(fd)
        os.unlink(name)


__all__ = ["CONF_DIR", "KvnotesError", "existing_ancestor", "try_new_entry"]
