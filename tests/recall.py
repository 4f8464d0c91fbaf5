"""Recall pairs on the embedded models, shared by the lanes (tests/lanes/test_embedded.py,
tests/lanes/test_gemma.py) and the probes' own tests: a SmolLM2 recall pair and its clean runs, and
Gemma-3-270M's pairs on a short recall scenario and on one longer than its 512-token sliding window,
with their screen.

A plugin (``pytest_plugins`` in tests/conftest.py): its fixtures reach every test without an import
(each loads an embedded model, so its tests are marked ``embedded``); the helpers are imported."""

from __future__ import annotations

import os

import pytest
import yaml
from omegaconf import OmegaConf

from kvnotes.harness.pairs import prepare_pairs
from kvnotes.harness.readout import run_pair
from kvnotes.harness.tokens import tokenize_pair
from kvnotes.probes import ProbeContext
from kvnotes.scenarios import build_pairs, load_suite
from tests.helpers import ROOT, probe_yaml

CONF = os.path.join(ROOT, "conf")

# --- SmolLM2-135M-Instruct ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smol_recall_pair(smol):
    """One pair of the shipped ``favourite_colour`` recall scenario, tokenized for SmolLM2."""
    specs = build_pairs(load_suite(["scenarios/suites"], ids=["favourite_colour"]), 1, 0)
    return tokenize_pair(smol.tokenizer, specs[0])


@pytest.fixture(scope="session")
def smol_pair_run(smol, smol_recall_pair):
    """The clean runs (old and new) of :func:`smol_recall_pair`."""
    return run_pair(smol.model, smol_recall_pair)


# --- Gemma-3-270M -------------------------------------------------------------------------------------

GEMMA_WINDOW = 512                # Gemma-3-270M's sliding window (tokens)

# Filler long enough to push a recall scenario past the sliding window: the field (in the context,
# before the filler) ends up more than GEMMA_WINDOW tokens before the decision position, so at the
# decision only the full-attention layers can still see it.
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December"]
_EVENTS = ["the customer updated the delivery address", "a parcel was returned to the warehouse",
           "the loyalty points were converted into a voucher", "support answered a billing question",
           "the newsletter preferences were changed", "an invoice was sent by post"]


def long_scenario(tmp_path) -> str:
    """The shipped ``favourite_colour`` recall scenario with 54 extra filler sentences (all drawn,
    ~550 tokens) and one value pair (each prefill of a ~650-token prompt costs seconds on 1 thread),
    written to a scenario file in ``tmp_path``; returns its path."""
    with open(os.path.join(ROOT, "scenarios", "suites", "recall", "favourite_colour.yaml")) as f:
        sc = yaml.safe_load(f)
    extra = [f"In {m}, {e}." for m in _MONTHS[:9] for e in _EVENTS]
    sc |= {"id": "favourite_colour_long", "filler": extra, "n_filler": len(extra)}
    sc["field"]["pairs"] = [["red", "blue"]]
    path = tmp_path / "favourite_colour_long.yaml"
    path.write_text(yaml.safe_dump(sc))
    return str(path)


def scenario_cfg(paths, n_instances=1):
    sc = OmegaConf.load(os.path.join(CONF, "scenario", "default.yaml"))
    sc.paths, sc.n_instances = list(paths), n_instances
    return sc


def gemma_ctx(gemma, pairs, name, flip_rule="owned", **over):
    """A context of probe ``name`` on Gemma-3-270M and ``pairs`` (``over``: probe settings)."""
    cfg = probe_yaml(name)
    cfg.progress = False
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return ProbeContext(bundle=gemma, pairs=pairs, cfg=cfg, seed=0, budget_bytes=256 << 20, flip_rule=flip_rule)


@pytest.fixture(scope="session")
def gemma_pairs(gemma, tmp_path_factory):
    """One instance of the shipped favourite_colour recall scenario (short) and of its long copy."""
    long_path = long_scenario(tmp_path_factory.mktemp("long"))
    short = os.path.join(ROOT, "scenarios", "suites", "recall", "favourite_colour.yaml")
    return prepare_pairs(gemma.tokenizer, scenario_cfg([short, long_path]))


@pytest.fixture(scope="session")
def gemma_screened(gemma, gemma_pairs):
    """The ``screen`` probe's result on :func:`gemma_pairs` (which pairs flip, under both rules)."""
    from kvnotes.probes.screen import run as run_screen

    return run_screen(gemma_ctx(gemma, gemma_pairs, "screen"))
