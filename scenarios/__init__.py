"""Gated-decision scenarios as data (YAML under ``scenarios/suites``) and the code that validates
them, draws instances with varied surface content, and renders old/new pairs.

See :mod:`kvnotes.scenarios.schema` for the file format and :mod:`kvnotes.scenarios.instances` for rendering.
"""

from kvnotes.scenarios.instances import Instance, PairSpec, build_pairs, draw_instances, render_user_text
from kvnotes.scenarios.schema import Scenario, load_scenario, load_suite

__all__ = ["Instance", "PairSpec", "Scenario", "build_pairs", "draw_instances", "load_scenario",
           "load_suite", "render_user_text"]
