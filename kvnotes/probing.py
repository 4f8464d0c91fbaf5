"""Deprecated alias of :mod:`kvnotes.kit` and :mod:`kvnotes.selection` for code written against
the old name (the name read as "linear probes"); import from those modules instead."""

from kvnotes.kit import (FlippingSet, exclusions_by_family, families_of, flipping_pairs,  # noqa: F401
                         recovery_summary, summaries_by_family)
from kvnotes.selection import pair_rng, sample_instances, split_instances  # noqa: F401
