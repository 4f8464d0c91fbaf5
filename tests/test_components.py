"""Residual decomposition of the components probe: embedding + every attention and MLP addition
== final pre-norm residual on every adapter architecture (Gemma-2/3 post-norms included), and the
projections onto the conclusion direction add up."""

from __future__ import annotations

import numpy as np
import torch

from circuits.components import contributions, decomposition_error, residual_parts, top_offset
from circuits.engine import NNsightEngine
from tests.conftest import VOCAB

TOL = 1e-4


def _ids(seed):
    return torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(seed))


def test_decomposition_sums_to_final_residual(tiny):
    engine = NNsightEngine(tiny)
    parts = residual_parts(engine, _ids(0))
    L = tiny.config.num_hidden_layers
    assert parts["attn"].shape == (L, 12, tiny.config.hidden_size)
    assert decomposition_error(parts) < TOL * float(parts["final"].abs().max())
    with torch.no_grad():
        hs = tiny(_ids(0)[None], output_hidden_states=True).hidden_states
    assert (parts["embed"] - hs[0][0]).abs().max() < TOL                 # adapter-free reference
    if engine.adapter.has_post_norms:
        # the raw sublayer outputs (before the post-norm) do NOT sum to the residual: the check
        # above would fail if the engine measured them instead of the residual additions
        from circuits.engine import Site
        raw = engine.run(_ids(0), capture=[Site("head", 0)]).acts[Site("head", 0)]
        o_proj = engine.adapter.module(tiny, "o_proj", 0)
        with torch.no_grad():
            pre_norm = o_proj(raw.flatten(2))[0]
        assert (pre_norm - parts["attn"][0]).abs().max() > 1e-3


def test_projections_add_up(tiny):
    engine = NNsightEngine(tiny)
    old, new = residual_parts(engine, _ids(0)), residual_parts(engine, _ids(1))
    u = torch.nn.functional.normalize(torch.randn(tiny.config.hidden_size, generator=torch.Generator().manual_seed(0)), dim=0)
    c = contributions(old, new, u, 7)
    assert c["sum_error"] < TOL * max(1.0, abs(c["final"]))
    assert abs(c["embed"] + sum(c["attn"]) + sum(c["mlp"]) - c["final"]) < TOL * max(1.0, abs(c["final"]))
    assert len(c["attn"]) == tiny.config.num_hidden_layers


def test_top_offset_counts_from_the_decision():
    maps = [np.array([0.0, 0.1, 0.9, 0.2]), np.array([0.5, 0.8, 0.1])]   # positions b..d-1
    # offsets (d - p): first map [0.2, 0.9, 0.1, 0.0], second [0.1, 0.8, 0.5] -> offset 2 wins
    assert top_offset(maps) == 2
    assert top_offset([]) is None
