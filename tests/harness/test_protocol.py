"""The harness's pair loop (:mod:`kvnotes.harness.protocol`): the two readouts score the same patched
variants alike when nothing is generated, and the loop partitions the pairs into rows and
exclusions by the documented rules, under both readouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvnotes.harness import kit
from kvnotes.harness.protocol import ScreenedPair, pair_loop, patch_columns, screen_generated
from kvnotes.harness.readout import run_pair
from kvnotes.kv.masks import KVSite
from tests.helpers import cot_tiny_ctx
from tests.kv.test_cache import prompts
from tests.probes.test_injection import synthetic_pair

#: nats / recovery units: a zero-token generated readout against the direct readout (batch shapes differ)
TOL = 1e-4
#: relative part of the same tolerance (tiny random models score up to a few nats)
REL = 1e-4


def test_zero_new_tokens_scores_like_the_direct_readout(tiny, monkeypatch):
    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: None)
    ctx = cot_tiny_ctx(tiny, monkeypatch)
    pair = synthetic_pair(*prompts())
    a, b = pair.field
    d = pair.decision
    direct = ScreenedPair(run_pair(tiny, pair), tiny)
    gen, row = screen_generated(ctx, pair, 0)
    assert gen is not None and gen.readout == "generated" and direct.readout == "direct"
    assert (gen.s_old, gen.s_new) == pytest.approx((direct.s_old, direct.s_new), abs=TOL)
    masks = direct.masks([[], list(range(a, b)), list(range(b, d)), list(range(d))])
    want, got = direct.score(masks), gen.score(masks)
    assert got.s == pytest.approx(want.s, abs=TOL, rel=REL) and got.r == pytest.approx(want.r, abs=TOL, rel=REL)
    assert want.r[0] == pytest.approx(0.0, abs=TOL) and want.r[-1] == pytest.approx(1.0, abs=TOL)
    assert all(want.reached) and want.chains is None
    assert all(got.reached) and got.chains is not None and all(c.length == 0 for c in got.chains)
    # direct sides follow the score's sign; flipped = the new run's side
    assert want.side == ["new" if s > 0 else "old" for s in want.s]
    assert want.flipped == [(s > 0) == (direct.s_new > 0) for s in want.s]


def test_head_sites_score_alike_under_both_readouts(tiny, monkeypatch):
    """A probe's variants may name KV heads (:class:`kvnotes.kv.masks.KVSite`): each downstream KV
    head alone moves the decision, but less than all of them together, which equal the plain position
    set; no head is the old run; the zero-token generated readout scores them as the direct one."""
    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: None)
    ctx = cot_tiny_ctx(tiny, monkeypatch)
    pair = synthetic_pair(*prompts())
    b, d = pair.field[1], pair.decision
    kvh = tiny.config.num_key_value_heads
    sets = {"downstream": range(b, d), "all_heads": KVSite(range(b, d), None, range(kvh)),
            "no_head": KVSite(range(b, d), None, []), **{f"h{h}": KVSite(range(b, d), None, [h]) for h in range(kvh)}}
    gen, _ = screen_generated(ctx, pair, 0)
    want, got = patch_columns(ScreenedPair(run_pair(tiny, pair), tiny), sets), patch_columns(gen, sets)
    for v in sets:
        assert got[f"r_{v}"] == pytest.approx(want[f"r_{v}"], abs=TOL, rel=REL)
    assert want["r_all_heads"] == pytest.approx(want["r_downstream"], abs=TOL)
    assert want["r_no_head"] == pytest.approx(0.0, abs=TOL)
    for h in range(kvh):
        assert abs(want[f"r_h{h}"]) > 10 * TOL and abs(want[f"r_h{h}"] - want["r_downstream"]) > 10 * TOL


def _ctx(model, n_pairs: int, flips: list[bool]):
    """A direct-readout context whose pair screen is scripted: ``flips[i]`` says whether pair ``i`` flips."""
    pairs = [synthetic_pair(*prompts(seed)) for seed in range(n_pairs)]
    runs = iter([(SimpleNamespace(pair=p), {"pair": f"p{i}", "scenario": "s", "family": "f", "instance": str(i),
                                            "flips": f, "reason": None if f else "small_effect"})
                 for i, (p, f) in enumerate(zip(pairs, flips))])
    return SimpleNamespace(pairs=SimpleNamespace(pairs=pairs, excluded=[{"pair": "t", "scenario": "s", "family": "f",
                                                                          "instance": "9", "reason": "tokenisation"}]),
                           scenario_cfg=None, bundle=SimpleNamespace(model=model), readout="first_token",
                           budget_bytes=1 << 20, timer=lambda name: __import__("contextlib").nullcontext()), runs


@pytest.mark.parametrize("scope", ["flipping", "all"])
def test_the_loop_partitions_pairs_by_the_rules(tiny, monkeypatch, scope):
    flips = [True, False, True, True]
    ctx, runs = _ctx(tiny, 4, flips)
    monkeypatch.setattr(kit, "each_pair", lambda ctx, desc: runs)
    seen = []
    pr = pair_loop(ctx, "t", lambda sp, row: seen.append(row["pair"]) or {"m": 1}, scope=scope,
                   exclude=lambda pair: "mine" if pair is ctx.pairs.pairs[2] else None, keep=True,
                   keep_caches=True)
    assert pr.readout == "direct" and pr.n_screened == 4
    reasons = [e["reason"] for e in pr.excluded]
    if scope == "flipping":
        assert seen == ["p0", "p3"] and reasons == ["tokenisation", "small_effect", "mine"]
    else:                                          # non-flipping pairs are measured and also listed
        assert seen == ["p0", "p1", "p3"] and reasons == ["tokenisation", "small_effect", "mine"]
    assert [r["pair"] for r in pr.rows] == seen and all(r["m"] == 1 for r in pr.rows)
    assert len(pr.pairs) == len(pr.rows) and pr.exclusions == {r: reasons.count(r) for r in set(reasons)}
    assert all(torch.is_tensor(sp.pair.old.ids) for sp in pr.pairs)
