"""Editing and composing KV caches (paper sections 5-6): :mod:`kvnotes.ops.edit` (field refresh,
selective recompute, errata) and :mod:`kvnotes.ops.compose` (RoPE re-positioning and splicing of
precompiled chunks). Usable alone: it imports nothing from ``scenarios``, ``probes`` or
:mod:`kvnotes.harness` (``tests/test_layout.py``)."""

from kvnotes.ops import compose, edit

__all__ = ["compose", "edit"]
