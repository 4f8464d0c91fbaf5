"""Causal probes on the KV cache, registered by name.

A probe is a module of this package exposing ``run(ctx: ProbeContext) -> dict``; its name is the
module name and its parameters live in ``conf/probe/<name>.yaml``. Probes never load models or
write files: ``run.py`` hands them a loaded model and token-aligned pairs and serialises the
returned result (``rows``, ``aggregates``, ``exclusions`` and probe-specific keys) into a record.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvnotes.cache import DEFAULT_BUDGET_BYTES
from kvnotes.errors import KvnotesError
from kvnotes.models import ModelBundle
from kvnotes.pairs import PairSet
from kvnotes.records import Timer


@dataclass
class ProbeContext:
    """What a probe gets: the model, the pairs, its config, the readout definition (mode, the flip
    rule ``owned``/``relative`` and its ``min_effect`` margin; ``docs/design.md``), a seed, a stage
    timer and the memory budget (bytes) for one chunk of batched variant caches (``budget_mb`` of
    the run config)."""

    bundle: ModelBundle
    pairs: PairSet
    cfg: Any
    readout: str = "first_token"
    min_effect: float = 1.0
    flip_rule: str = "owned"
    seed: int = 0
    timer: Timer = field(default_factory=Timer)
    scenario_cfg: Any = None
    budget_bytes: int = DEFAULT_BUDGET_BYTES


def names() -> list[str]:
    """Registered probe names: modules of the ``probes`` and ``circuits`` packages with ``run``."""
    import circuits

    found = []
    for pkg in (__import__(__name__), circuits):
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_") and hasattr(importlib.import_module(f"{pkg.__name__}.{info.name}"), "run"):
                found.append(info.name)
    return sorted(found)


def module(name: str):
    """The module of probe ``name`` (it has ``run(ctx) -> dict``; ``SUPPORTS_COT = True`` when it
    generates the reasoning of ``scenario.variant=cot`` before reading the decision).

    Raises:
        KvnotesError: no probe of that name.
    """
    for pkg in ("probes", "circuits"):
        try:
            mod = importlib.import_module(f"{pkg}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{pkg}.{name}":
                raise
            continue
        if hasattr(mod, "run"):
            return mod
    raise KvnotesError(f"unknown probe '{name}' (known: {', '.join(names())})")


def get(name: str) -> Callable[[ProbeContext], dict]:
    """The ``run`` function of probe ``name`` (see :func:`module`)."""
    return module(name).run


def check_variant(name: str, variant: str) -> None:
    """Refuse a chain-of-thought prompt variant for a probe that would score the decision right
    after the reasoning opener, with no reasoning generated.

    Raises:
        KvnotesError: ``variant == "cot"`` and the probe does not declare ``SUPPORTS_COT``.
    """
    if variant == "cot" and not getattr(module(name), "SUPPORTS_COT", False):
        able = [n for n in names() if getattr(module(n), "SUPPORTS_COT", False)]
        raise KvnotesError(f"probe '{name}' reads the decision right after the answer prefix and generates no "
                           f"reasoning, so it does not support scenario.variant=cot"
                           f" (probes that do: {', '.join(able) or 'none'})")
