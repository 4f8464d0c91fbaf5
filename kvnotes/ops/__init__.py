"""Editing and composing KV caches (paper sections 5-6): :mod:`kvnotes.ops.edit` (field refresh,
selective recompute, errata), :mod:`kvnotes.ops.methods` (the edit methods, each declared once, and
the rankings: the registry every edit reader reads), :mod:`kvnotes.ops.edit_runner` (those edits as one forward on a reused KV
pool, CUDA graphs on GPU), :mod:`kvnotes.ops.chunk` (precompiled chunks), :mod:`kvnotes.ops.compose`
(splicing precompiled chunks after a prefix), :mod:`kvnotes.ops.slots` (the slot pool, its one-forward
attention and CUDA graphs, shared by the two runners) and :mod:`kvnotes.ops.mrope` (the 3-D positions
of M-RoPE models). Usable alone: it imports nothing from ``scenarios``, ``probes`` or
:mod:`kvnotes.harness` (``tests/lanes/test_layout.py``)."""

from kvnotes.ops import chunk, compose, edit, edit_runner, methods, mrope, slots

__all__ = ["chunk", "compose", "edit", "edit_runner", "methods", "mrope", "slots"]
