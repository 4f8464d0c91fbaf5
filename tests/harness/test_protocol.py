"""The harness's pair loop (:mod:`kvnotes.harness.protocol`): the two readouts score the same patched
variants alike when nothing is generated, K/V head sites split the planted read heads by their planted
shares, and the loop partitions the pairs into rows and exclusions by the documented rules, under both
readouts."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvnotes.harness import kit
from kvnotes.harness.protocol import pair_loop, patch_columns
from kvnotes.harness.screened import ScreenedPair, screen_generated
from kvnotes.harness.readout import run_pair
from kvnotes.kv.sites import kv_site
from tests.helpers import cot_tiny_ctx
from tests.kv.test_cache import FIELD, VOCAB, prompts
from tests.probes.test_injection import synthetic_pair
from tests.planted import BAR, EXACT, marker_positions, planted_context, planted_truth

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


def test_zero_new_tokens_knocks_out_like_the_direct_readout(tiny, monkeypatch):
    """The knockout executor (:meth:`ScreenedPair.knockout`) under both readouts: with nothing
    generated, each run's knocked scores, log-probs and decision-query masses are the direct
    readout's (the generated one adds the ``chain`` group, empty); variant 0 re-reads the clean run,
    knocked keys get no mass, and the masses sum to 1."""
    from kvnotes.harness.screened import mass_groups
    from kvnotes.kv.knockout import GROUPS, key_groups, knockout_masks

    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: None)
    ctx = cot_tiny_ctx(tiny, monkeypatch)
    pair = synthetic_pair(*prompts())
    L, d = tiny.config.num_hidden_layers, pair.decision
    groups = key_groups(pair.field, d, 1)
    knock = knockout_masks(L, d, groups, [([], [0, L]), (["field"], [0, L]), (["downstream", "sinks"], [1, L])])
    direct = ScreenedPair(run_pair(tiny, pair), tiny)
    gen, _ = screen_generated(ctx, pair, 0)
    want, got = direct.knockout(knock, groups), gen.knockout(knock, groups)
    assert list(want) == list(got) == ["old", "new"]
    assert want["old"].groups == mass_groups("direct") == GROUPS and got["old"].groups == mass_groups("generated")
    for run in ("old", "new"):
        w, g = want[run], got[run]
        assert w.s[0] == pytest.approx(getattr(direct, f"s_{run}"), abs=TOL, rel=REL)
        assert g.s == pytest.approx(w.s, abs=TOL, rel=REL) and all(g.reached) and g.lengths == [0, 0, 0]
        assert torch.allclose(g.logprobs, w.logprobs, atol=TOL)
        assert w.masses.shape == (3, 1, L, len(GROUPS))
        assert torch.allclose(g.masses[:, :1, :, : len(GROUPS)], w.masses, atol=TOL)
        assert float(g.masses[..., -1].abs().max()) == 0.0                    # no chain to attend to
        assert torch.allclose(w.masses.sum(-1), torch.ones(3, 1, L), atol=TOL)
        assert float(w.masses[1, :, :, GROUPS.index("field")].max()) == 0.0
        assert float(w.masses[2, :, 1:, [GROUPS.index("downstream"), GROUPS.index("sinks")]].max()) == 0.0
        assert torch.equal(w.reading_masses(0), w.masses[0, 0]) and max(w.recon_err, g.recon_err) < TOL
        assert direct.chain_columns(w, 1, chain="chain", side="side") == {}
        assert set(gen.chain_columns(g, 1, chain="chain", side="side")) == {"chain", "side"}


def test_each_prompts_clean_chain_decodes_once(tiny, monkeypatch):
    """The generated screen's memo (the pair loop's): pairs that share a prompt (a value that is the
    old run of one pair and the new run of another) decode its clean chain once, and screen as they
    do alone: the same chains token for token, the same scores and flips."""
    from kvnotes.kv import generate as kvgen

    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: lambda ids: len(ids) >= 2)
    ctx = cot_tiny_ctx(tiny, monkeypatch)
    a, b = prompts(1)
    c = a.clone()                                                  # a third value of the field
    c[FIELD[0]:FIELD[1]] = (b[FIELD[0]:FIELD[1]] + 1) % VOCAB
    pairs = [synthetic_pair(a, b), synthetic_pair(b, a), synthetic_pair(a, c), synthetic_pair(c, b)]
    decoded = []
    real = kvgen.generate
    monkeypatch.setattr(kvgen, "generate", lambda *args, **kw: decoded.append(len((g := real(*args, **kw)).chains)) or g)
    alone = [screen_generated(ctx, p, 3)[1] for p in pairs]
    assert sum(decoded) == 2 * len(pairs)
    decoded.clear()
    memo: dict = {}
    shared = [screen_generated(ctx, p, 3, memo)[1] for p in pairs]
    assert sum(decoded) == len(memo) == 3                          # a, b, c: one chain each
    for want, got in zip(alone, shared):
        assert got["chain_old"] == want["chain_old"] and got["chain_new"] == want["chain_new"]
        assert got["chain_old"]["length"] == 2 and got["chain_old"]["reached"]
        assert (got["s_old"], got["s_new"]) == pytest.approx((want["s_old"], want["s_new"]), abs=TOL, rel=REL)
        assert (got["flips"], got["reason"]) == (want["flips"], want["reason"])


def test_head_sites_score_alike_under_both_readouts(tiny, monkeypatch):
    """A probe's variants may name KV heads (:func:`kvnotes.kv.sites.kv_site`): each downstream KV
    head alone moves the decision, but less than all of them together, which equal the plain position
    set; no head is the old run; the zero-token generated readout scores them as the direct one."""
    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: None)
    ctx = cot_tiny_ctx(tiny, monkeypatch)
    pair = synthetic_pair(*prompts())
    b, d = pair.field[1], pair.decision
    kvh = tiny.config.num_key_value_heads
    sets = {"downstream": range(b, d), "all_heads": kv_site(range(b, d), None, range(kvh)),
            "no_head": kv_site(range(b, d), None, []), **{f"h{h}": kv_site(range(b, d), None, [h]) for h in range(kvh)}}
    gen, _ = screen_generated(ctx, pair, 0)
    want, got = patch_columns(ScreenedPair(run_pair(tiny, pair), tiny), sets), patch_columns(gen, sets)
    for v in sets:
        assert got[f"r_{v}"] == pytest.approx(want[f"r_{v}"], abs=TOL, rel=REL)
    assert want["r_all_heads"] == pytest.approx(want["r_downstream"], abs=TOL)
    assert want["r_no_head"] == pytest.approx(0.0, abs=TOL)
    for h in range(kvh):
        assert abs(want[f"r_h{h}"]) > 10 * TOL and abs(want[f"r_h{h}"] - want["r_downstream"]) > 10 * TOL


def test_kv_head_sites_split_the_planted_read_heads(planted_cache, monkeypatch):
    """Head patches and head knockouts (:func:`kvnotes.kv.sites.kv_site`) on the Llama construction,
    one KV head per query head (the Gemma-3 one shares a single KV head, so KV heads cannot split its
    read heads). In the read layer, the notes read head's K/V at the note marker carries ``1 - alpha``
    of each decision and the field read head's K/V at the field ``alpha``; the other head at each
    site carries nothing. Patched from the new run, each recovers its share; hidden from the decision
    query, each moves the score its share of ``beta`` towards the other run's."""
    from kvnotes.kv.knockout import decision_forward
    from kvnotes.kv.masks import site_masks
    from kvnotes.models import planted

    ctx = planted_context(planted_cache, monkeypatch, "mixed", "field_refresh", {"planted": {"alpha": 0.3}},
                          n_instances=1, scenario_ids=["adjacent"])
    model, truth = ctx.bundle.model, planted_truth(ctx)
    alpha, beta = truth["alpha"], truth["beta"]
    (layer, notes_head), = truth["read_heads"]["notes"]
    (field_layer, field_head), = truth["read_heads"]["field"]
    assert field_layer == layer and ctx.pairs.pairs
    share = {"notes": 1 - alpha, "field": alpha, "notes_other": 0.0, "field_other": 0.0}
    for pair in ctx.pairs.pairs:
        note, field = [marker_positions(ctx, pair)["note"]], range(*pair.field)
        sites = {"notes": kv_site(note, [layer], [notes_head]), "field": kv_site(field, [layer], [field_head]),
                 "notes_other": kv_site(note, [layer], [field_head]), "field_other": kv_site(field, [layer], [notes_head])}
        run = run_pair(model, pair)
        cols = patch_columns(ScreenedPair(run, model), sites)
        knock = site_masks(planted.N_LAYERS, pair.decision, list(sites.values()), model.config.num_key_value_heads)
        for cache_, s_clean, s_other in ((run.old_cache, run.s_old, run.s_new), (run.new_cache, run.s_new, run.s_old)):
            lp = decision_forward(model, cache_, pair.old.ids[pair.decision: pair.decision + 1], knock).logprobs[:, 0]
            moved = (lp[:, pair.cand_new[0]] - lp[:, pair.cand_old[0]] - s_clean) * np.sign(s_other - s_clean)
            for i, (name, part) in enumerate(share.items()):
                assert cols[f"r_{name}"] == pytest.approx(part, abs=EXACT), name
                assert float(moved[i]) == pytest.approx(part * beta, abs=BAR * beta), name


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


#: The probes that still ask which readout runs (issue #51): none; a new one fails the test.
STILL_BRANCHING: set[str] = set()
#: How a module asks: the scenario variant, a ``generated`` flag, a readout compared, chains tested.
READOUT_BRANCH = re.compile(r"\bis_cot\(|\bgenerated\s*=|\bcot_on\b|[!=]=\s*['\"](?:generated|direct|cot)['\"]"
                            r"|chains is not None")


def test_probes_run_on_the_protocols_readout():
    """A probe module (its package included) leaves the readout to the protocol: columns from
    ``ScreenedPair.chain_columns``, checks declared with their readouts, measurements with theirs."""
    root = Path(kit.__file__).resolve().parents[2]
    branching = set()
    for folder in ("probes", "circuits"):
        for path in (root / folder).rglob("*.py"):
            name = path.parent.name if path.parent.name not in ("probes", "circuits") else path.stem
            if READOUT_BRANCH.search(path.read_text()):
                branching.add(name)
    assert branching == STILL_BRANCHING, (f"new readout branches: {sorted(branching - STILL_BRANCHING)}; "
                                          f"no longer branching (drop them): {sorted(STILL_BRANCHING - branching)}")
    assert READOUT_BRANCH.search("generated = K.is_cot(ctx)") and not READOUT_BRANCH.search("pr.checks(CHECKS)")
