"""kvnotes: activation patching on the transformers KV cache.

Shared machinery: models and architecture adapters, tokenisation and spans, cache surgery,
readout, statistics and records. Probes live in ``probes/``, scenarios in ``scenarios/``.
"""

from kvnotes.errors import KvnotesError

__all__ = ["KvnotesError"]
