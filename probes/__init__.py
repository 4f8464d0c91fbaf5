"""Causal probes on the KV cache: one module per probe, ``run(ctx: ProbeContext) -> dict``.

The registry and :class:`ProbeContext` live in :mod:`kvnotes.harness.registry` and are re-exported
here, so ``kvnotes.probes.get(name)`` and ``from kvnotes.probes import ProbeContext`` keep working. See
``docs/adding_a_probe.md``.
"""

from kvnotes.harness.registry import (CONF_DIR, ProbeContext, check_variant, get, load_config, module, names,
                                      typed_config)

__all__ = ["CONF_DIR", "ProbeContext", "check_variant", "get", "load_config", "module", "names", "typed_config"]
