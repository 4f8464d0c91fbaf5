"""Head patching: read/write invariants against cache patching, batching, resumed prefills, and
selection that never sees held-out instances; on the planted constructions the planted read and write
heads rank first, from a map that represents the family's mechanisms."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvnotes.probes
from kvnotes.kv.engine import Intervention, NNsightEngine
from kvnotes.kv.sites import Site
from kvnotes.harness.selection import pair_rng, random_head_sets, rank_by_mean, with_split
from kvnotes.circuits.heads import map_pairs
from kvnotes.harness.head_patch import clean_residuals, head_outputs, patched_scores, set_masks, single_head_map
from kvnotes.kv import cache as kvcache
from kvnotes.kv import patch as kvpatch
from kvnotes.harness.readout import first_token_scores, run_pair, variant_scores
from tests.helpers import VOCAB, build_tiny, check_schema, probe_yaml
from tests.planted import planted_context, planted_truth

T, A, B = 15, 4, 6          # prompt length, field span [A, B); decision d = T - 1


def synthetic_pair(model):
    """An old/new pair differing only in the field, with candidates = each run's argmax at d."""
    for seed in range(50):
        g = torch.Generator().manual_seed(seed)
        old = torch.randint(0, VOCAB, (T,), generator=g)
        new = old.clone()
        new[A:B] = torch.randint(0, VOCAB, (B - A,), generator=g)
        with torch.no_grad():
            co, cn = int(model(old[None]).logits[0, -1].argmax()), int(model(new[None]).logits[0, -1].argmax())
        if co != cn:
            return SimpleNamespace(old=SimpleNamespace(ids=old), new=SimpleNamespace(ids=new), field=(A, B),
                                   decision=T - 1, downstream=(B, T - 1), cand_old=(co,), cand_new=(cn,))
    raise RuntimeError("no flipping synthetic pair")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request):
    model = build_tiny(request.param)
    engine = NNsightEngine(model)
    pair = synthetic_pair(model)
    run = run_pair(model, pair)
    return model, engine, pair, run, head_outputs(engine, pair.new.ids)


def test_read_all_heads_is_one_and_none_is_zero(setup):
    model, engine, pair, run, src = setup
    L, H = engine.adapter.n_layers, engine.adapter.n_heads
    every = [(l, h) for l in range(L) for h in range(H)]
    s = patched_scores(engine, run, src, set_masks([every, []], L, H), "read", run.old_cache, 4)
    r = run.recovery(s)
    assert r[0] == pytest.approx(1.0, abs=1e-4) and r[1] == pytest.approx(0.0, abs=1e-5)


def test_write_all_heads_equals_downstream_kv_patch(setup):
    """Every head's output at [b, d) from the new run == the new run's KV at [b, d) (every layer):
    checks the resumed prefill against kvnotes.kv.cache patching."""
    model, engine, pair, run, src = setup
    L, H = engine.adapter.n_layers, engine.adapter.n_heads
    prefix = kvcache.prefix_cache(model, run.old_cache, pair.old.ids, B)
    s = patched_scores(engine, run, src, set_masks([[(l, h) for l in range(L) for h in range(H)]], L, H), "write",
                       prefix, 4)
    ref = variant_scores(model, pair, run.old_cache, run.new_cache,
                         kvpatch.position_masks(L, pair.decision, [list(range(B, pair.decision))]))
    assert float(s[0]) == pytest.approx(float(ref[0]), abs=1e-4)
    assert abs(float(run.recovery(s)[0])) > 1e-3           # it is a finding, not a trivial 0


def test_resumed_write_equals_full_rerun_and_batching_is_exact(setup):
    model, engine, pair, run, src = setup
    L, H = engine.adapter.n_layers, engine.adapter.n_heads
    d = pair.decision
    prefix = kvcache.prefix_cache(model, run.old_cache, pair.old.ids, B)
    sets = [[(l, h)] for l in range(L) for h in range(H)]
    batched = patched_scores(engine, run, src, set_masks(sets, L, H), "write", prefix, 7)
    one = patched_scores(engine, run, src, set_masks(sets, L, H), "write", prefix, 1)
    assert (batched - one).abs().max() < 1e-4
    pos = list(range(B, d))
    for v, [(l, h)] in enumerate(sets[:: max(1, len(sets) // 3)]):
        iv = Intervention(Site("hook_z", l, pos, heads=[h]), src[l, pos][None, :, [h]])
        lp = engine.run(pair.old.ids[: d + 1], [iv]).logprobs          # full prefill from 0
        full = float(first_token_scores(lp[:, -1], pair)[0])
        idx = sets.index([(l, h)])
        assert full == pytest.approx(float(batched[idx]), abs=1e-4)
    m = single_head_map(engine, run, src, "read", run.old_cache, 5)
    assert m.shape == (L, H) and np.isfinite(m).all()


def test_write_chunks_start_at_their_lowest_layer_with_the_same_scores(setup):
    """Write variants resumed at their lowest patched layer from the clean residual (layers below
    skipped) score what the full-depth forward scores, whatever the chunking and set order."""
    model, engine, pair, run, src = setup
    L, H = engine.adapter.n_layers, engine.adapter.n_heads
    prefix = kvcache.prefix_cache(model, run.old_cache, pair.old.ids, B)
    resid = clean_residuals(engine, run, prefix)
    assert resid.shape[:2] == (L, pair.decision - B + 1)
    rng = np.random.default_rng(0)
    sets = ([[(l, h)] for l in reversed(range(L)) for h in range(H)] + [[]]
            + random_head_sets(rng, L, H, 3, 4) + [[(L - 1, 0), (1, 1)]])
    masks = set_masks(sets, L, H)
    full = patched_scores(engine, run, src, masks, "write", prefix, 5)
    for chunk in (1, 5):
        resumed = patched_scores(engine, run, src, masks, "write", prefix, chunk, resid)
        assert (resumed - full).abs().max() < 1e-4
    assert float(run.recovery(full)[len(sets) - 6]) == pytest.approx(0.0, abs=1e-5)    # the empty set
    with pytest.raises(ValueError, match="below the resume layer"):
        engine.run(pair.old.ids[B:], [Intervention(Site("hook_z", 0, [B]), src[0, [B]][None])], cache=prefix,
                   start=B, resume=(1, resid[1][None]))


def test_selection_never_uses_heldout_instances():
    rows = [{"pair": f"s{s}/{i}:{j}", "scenario": f"s{s}", "instance": f"s{s}/{i}", "family": "recall"}
            for s in range(3) for i in range(4) for j in range(2)]
    rows, sel, held = with_split(rows, 0.5, seed=0)
    assert sel and held and not sel & held
    mapped = map_pairs(rows, None, 0)
    assert all(r["split"] == "selection" for r in rows if r["pair"] in mapped)
    assert len(map_pairs(rows, 2, 0)) == 2 and map_pairs(rows, 2, 0) <= mapped
    # a poisoned held-out map cannot change the ranking: rank_heads only sees what it is given,
    # and the probe passes it selection maps only
    sel_maps = [np.array([[0.1, 0.5], [0.2, 0.0]]) for _ in range(2)]
    order = rank_by_mean(sel_maps)
    assert order[0] == (0, 1) and order[1] == (1, 0)
    with pytest.raises(ValueError):
        rank_by_mean([])


def test_top_k_sizes_the_model_cannot_fill_are_said_or_refused():
    """``ks`` above the model's heads are dropped and the run's ``warnings`` say which; when none is
    left the probe refuses in one line (a ``ModelFitError``) before any work."""
    from kvnotes.circuits.heads import head_ks
    from kvnotes.errors import ModelFitError

    assert head_ks([8, 1, 4, 1, 32], 2, 4) == ([1, 4, 8], [32])
    with pytest.raises(ModelFitError, match=r"probe.ks=\[16, 32\]: every k exceeds the model's 8 heads \(2 layers x 4\)"):
        head_ks([16, 32], 2, 4)


def test_random_head_sets_are_k_matched_distinct_and_seeded():
    draws = random_head_sets(pair_rng(0, "p"), 3, 4, 5, 6)
    assert len(draws) == 6 and all(len(d) == 5 and len(set(d)) == 5 for d in draws)
    assert all(0 <= l < 3 and 0 <= h < 4 for d in draws for l, h in d)
    assert draws == random_head_sets(pair_rng(0, "p"), 3, 4, 5, 6)
    assert draws != random_head_sets(pair_rng(1, "p"), 3, 4, 5, 6)


def test_probe_run_on_embedded_model_with_capped_maps(smol):
    """``run(ctx)`` end to end with fewer mapped selection pairs than selection pairs (the default
    cap), so aggregates must only use the pairs that were mapped."""

    from kvnotes.circuits.heads import run as run_heads
    from kvnotes.probes import ProbeContext
    from tests.helpers import recall_pairs

    cfg = probe_yaml("heads")
    cfg.progress, cfg.n_boot, cfg.ks, cfg.random.n_draws, cfg.max_map_pairs_per_family = False, 200, [1, 4], 2, 1
    # read heads only, two pairs per instance: the write sweep costs n_layers * n_heads resumed
    # prefills per mapped pair (minutes on a CPU); it is checked on tiny models above
    cfg.modes = ["read"]
    ctx = ProbeContext(bundle=smol, pairs=recall_pairs(smol, ["favourite_colour"], per_instance=2), cfg=cfg, seed=0)
    res = run_heads(ctx)
    check_schema("heads", res)
    agg = res["aggregates"]
    assert agg["n_selection"] >= 2 and agg["n_heldout"] >= 1
    # a cap of one pair maps one whole instance (its pairs are not independent of each other)
    mapped = [r for r in res["rows"] if "maps" in r]
    assert len({r["instance"] for r in mapped}) == 1 and all(r["split"] == "selection" for r in mapped)
    assert agg["selection_maps"]["read"]["recall"]["n"] == len(mapped)
    assert agg["checks"]["ranking_pairs_in_heldout"] == 0
    assert agg["checks"]["max_abs_read_all_minus_1"] < 1e-4
    assert agg["checks"]["random_set_sizes_match_k"]
    assert agg["modes"] == ["read"] and "write" not in agg["curves"] and "topk_write" not in res["rows"][-1]
    held = agg["curves"]["read"]["topk"]["1"]["recall"]
    assert held["n"] == agg["n_heldout"] and np.isfinite(held["mean"])


# --- the planted constructions (tests/planted.py) -------------------------------------------------


@pytest.mark.planted("heads")
def test_heads_ranks_the_planted_read_and_write_heads_first(planted_arch, planted_cache, monkeypatch):
    """Mixed family (alpha 0.3): the notes read head (1, 0) ranks first, the field read head (1, 1)
    second; the write head (0, 0) leads the write side; on the delimiter family the distractor
    (1, 2), which reads the field and writes nothing used, ranks below every head the decision uses."""
    ctx = planted_context(planted_cache, monkeypatch, "mixed", "heads", {"planted": {"alpha": 0.3}},
                          scenario_ids=["adjacent"], arch=planted_arch)
    ranks = kvnotes.probes.get(ctx.cfg)(ctx)["aggregates"]["rankings"]
    truth = planted_truth(ctx)
    assert ranks["read"]["planted"]["top"][:2] == truth["read_heads"]["notes"] + truth["read_heads"]["field"]
    assert ranks["write"]["planted"]["top"][:1] == truth["write_heads"]
    ctx = planted_context(planted_cache, monkeypatch, "delimiter", "heads", scenario_ids=["delimited"],
                          arch=planted_arch)
    ranks = kvnotes.probes.get(ctx.cfg)(ctx)["aggregates"]["rankings"]["read"]["planted"]["top"]
    truth = planted_truth(ctx)
    used = truth["read_heads"]["notes"]                               # alpha 0: the field read head writes nothing
    assert ranks[0] == used[0] and truth["distractor_heads"][0] not in ranks[:ranks.index(used[0]) + 1]


def _heads(cache, monkeypatch, arch, cap: int, seed: int):
    """The read side of ``heads`` on the mixed family (alpha 0.3) over ``planted_varied``'s scenarios with
    and without notes (issue #53), mapping at most ``cap`` pairs per family."""
    ctx = planted_context(cache, monkeypatch, "mixed", "heads", {"planted": {"alpha": 0.3}},
                          {"max_map_pairs_per_family": cap, "modes": ["read"]}, ["with_notes", "without_notes"],
                          n_instances=4, arch=arch, suite="planted_varied", seed=seed)
    return ctx, kvnotes.probes.get(ctx.cfg)(ctx)


def test_heads_maps_both_mechanisms_and_a_one_scenario_map_is_not_supported(planted_arch, planted_cache,
                                                                            monkeypatch):
    """With the default cap the map pairs are stratified over the family's scenarios: the planted
    read heads rank first. A cap of one pair maps one scenario; drawn from the scenario without
    notes (seed 3; on Llama, the Gemma-3 case being the same) the notes read head falls behind heads that read nothing, and the record says
    so: a warning, and no ``supported`` verdict, naming the scenarios that disagree."""
    ctx, res = _heads(planted_cache, monkeypatch, planted_arch, 2, 0)
    truth = planted_truth(ctx)
    read = [list(h) for h in truth["read_heads"]["notes"] + truth["read_heads"]["field"]]
    rank = res["aggregates"]["rankings"]["read"]["planted_mechanisms"]
    assert sorted(rank["top"][:2]) == sorted(read)
    assert {p.split("/")[0] for p in rank["pairs"]} == {"with_notes", "without_notes"}
    assert res["aggregates"]["map_coverage"]["planted_mechanisms"]["represents"]
    if planted_arch != "llama":                      # the failure case once (it is the same on Gemma-3)
        return

    ctx, res = _heads(planted_cache, monkeypatch, planted_arch, 1, 3)
    rank = res["aggregates"]["rankings"]["read"]["planted_mechanisms"]
    assert [p.split("/")[0] for p in rank["pairs"]] == ["without_notes"]
    assert rank["top"].index(read[0]) > 1                                    # the notes read head is not in the top 2
    assert any("comes from 1 of its 2 scenarios" in w for w in res["warnings"])
    cell = res["aggregates"]["verdicts"]["read"]["by_family"]["planted_mechanisms"]
    assert cell["verdict"] != "supported"
    assert sorted(cell["disagree"]) == ["with_notes", "without_notes"] and "scenarios disagree" in cell["reason"]
    with_notes = cell["scenarios"]["with_notes"]["selected"]["mean"]
    without = cell["scenarios"]["without_notes"]["selected"]["mean"]
    assert with_notes < without - 0.1                                        # the ranking fits one scenario only
