"""Gated-decision scenarios as data (YAML under ``scenarios/suites``) and the code that validates
them, draws instances with varied surface content, and renders old/new pairs.

See :mod:`scenarios.schema` for the file format and :mod:`scenarios.instances` for rendering.
"""

from scenarios.instances import Instance, PairSpec, build_pairs, draw_instances, render_user_text
from scenarios.schema import Scenario, load_scenario, load_suite

__all__ = ["Instance", "PairSpec", "Scenario", "build_pairs", "draw_instances", "load_scenario",
           "load_suite", "render_user_text"]
