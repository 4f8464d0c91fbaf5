"""Direction probe: norm- and k-matched random controls, leave-one-scenario-out fits, layer choice
without held-out instances, exactness of full-difference injection through the engine, an
end-to-end run on the embedded model, and on the planted constructions the planted value direction."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import kvnotes.circuits.direction as D
import kvnotes.probes
from kvnotes.errors import KvnotesError
from kvnotes.harness.kit import scan_layers
from kvnotes.kv.engine import Intervention, NNsightEngine
from kvnotes.kv.sites import Site
from kvnotes.kv import cache as kvcache
from kvnotes.harness.readout import first_token_scores, run_pair
from kvnotes.harness.selection import pair_rng, with_split
from tests.helpers import check_schema, build_tiny, probe_yaml
from kvnotes.models import planted
from tests.circuits.test_heads import synthetic_pair
from tests.planted import BAR, planted_context, planted_truth

HID = 64


def test_random_controls_are_norm_and_k_matched():
    g = torch.Generator().manual_seed(0)
    delta = torch.randn(7, HID, generator=g) * torch.linspace(0.1, 5, 7)[:, None]   # uneven norms per position
    u = torch.nn.functional.normalize(torch.randn(HID, generator=g), dim=0)
    rand = D.random_directions(pair_rng(3, "pair/x"), 4, HID)
    inj = D.injections(delta, u, rand)
    assert inj["random"].shape == (4,) + inj["direction"].shape                 # same positions, same width
    real = inj["direction"].norm(dim=-1)
    for k in range(4):
        # per position (hence per pair) the random injection has the real injection's norm
        assert torch.allclose(inj["random"][k].norm(dim=-1), real, rtol=1e-5, atol=1e-6)
        assert inj["random"][k].norm() == pytest.approx(float(inj["direction"].norm()), rel=1e-5)
        # one dimension, like the real injection: rank 1 along its own direction
        assert torch.linalg.matrix_rank(inj["random"][k]) == 1
        assert torch.allclose(torch.nn.functional.normalize(inj["random"][k], dim=-1).abs() @ rand[k].abs(),
                              torch.ones(7), atol=1e-5)
    # a projection on the random direction would not be norm-matched: the test above would fail for it
    assert not torch.allclose((delta @ rand[0])[:, None].abs().squeeze(), real, rtol=1e-2)
    assert torch.allclose(inj["direction"] + inj["orthogonal"], delta, atol=1e-5)
    assert (inj["orthogonal"] @ u).abs().max() < 1e-4
    assert torch.allclose(rand.norm(dim=-1), torch.ones(4), atol=1e-6)
    assert torch.equal(rand, D.random_directions(pair_rng(3, "pair/x"), 4, HID))
    assert not torch.equal(rand, D.random_directions(pair_rng(4, "pair/x"), 4, HID))
    # necessity: every variant sets the projection on its own direction to its target, same positions
    x = torch.randn(7, HID, generator=g)
    dirs = torch.cat([u[None], rand])
    mu = torch.arange(5, dtype=torch.float32)
    add = D.ablations(x, dirs, mu)
    assert add.shape == (5, 7, HID)
    for k in range(5):
        assert torch.allclose((x + add[k]) @ dirs[k], mu[k].expand(7), atol=1e-4)


def _stats():
    """Fitting residuals of five scenarios; B2 lists its values the other way round (its old run
    decides Y), C decides another outcome pair, A is 1000x larger (a leak would show)."""
    g = torch.Generator().manual_seed(1)
    stats, vals = {}, {}
    for scen, fam, outs, n_pos, scale in (("A", "f", ("X", "Y"), 3, 1000.0), ("B", "f", ("X", "Y"), 4, 1.0),
                                          ("B2", "f", ("Y", "X"), 2, 1.0), ("C", "f", ("P", "Q"), 3, 1.0),
                                          ("Z", "g", ("X", "Y"), 5, 1.0)):
        for i in range(2):
            xo = torch.randn(2, n_pos, HID, generator=g) * scale
            xn = torch.randn(2, n_pos, HID, generator=g) * scale + 3.0
            row = {"pair": f"{scen}/{i}:p", "scenario": scen, "instance": f"{scen}/{i}", "family": fam}
            D.accumulate(stats, row, outs, xo, xn)
            vals[row["instance"]] = dict(zip(outs, (xo, xn)))
    return stats, vals


def _pooled(vals, insts, outcome):
    return torch.cat([vals[i][outcome] for i in insts], 1).mean(1)


def test_fits_group_runs_by_conclusion_and_share_outcome_pairs():
    stats, vals = _stats()
    row = {"pair": "A/0:p", "scenario": "A", "instance": "A/0", "family": "f"}
    fit = D.fit_direction(stats, row, ("X", "Y"), "family")
    # leave-one-scenario-out, same family, same outcome pair: B and B2 (B2's runs by conclusion)
    assert fit.scenarios == ["B", "B2"] and fit.n_pairs == 4 and fit.n_pos == 12
    insts = ["B/0", "B/1", "B2/0", "B2/1"]
    exp_x, exp_y = _pooled(vals, insts, "X"), _pooled(vals, insts, "Y")
    assert torch.allclose(fit.mean_old, exp_x, atol=1e-5) and torch.allclose(fit.mean_new, exp_y, atol=1e-5)
    assert torch.allclose(fit.u, torch.nn.functional.normalize(exp_y - exp_x, dim=-1), atol=1e-5)
    # labelling by list order instead (B2's old run counted as X) gives a different direction
    by_order = torch.cat([vals["B/0"]["X"], vals["B/1"]["X"], vals["B2/0"]["Y"], vals["B2/1"]["Y"]], 1).mean(1)
    assert (by_order - exp_x).abs().max() > 0.5
    # A is 1000x larger: had it leaked into the fit the means would be far away
    assert (fit.mean_old - _pooled(vals, ["A/1"] + insts, "X")).abs().max() > 1.0
    # signs aligned to the evaluated pair: the reverse pair gets the opposite direction
    rev = D.fit_direction(stats, row, ("Y", "X"), "family")
    assert torch.allclose(rev.u, -fit.u, atol=1e-5)
    assert torch.allclose(fit.mu(1, fit.u[1:2], "all"), ((exp_x[1] + exp_y[1]) / 2 @ fit.u[1])[None], atol=1e-4)
    assert torch.allclose(fit.mu(1, fit.u[1:2], "old"), (exp_x[1] @ fit.u[1])[None], atol=1e-4)
    assert D.fit_direction(stats, row, ("X", "Y"), "all").scenarios == ["B", "B2", "Z"]
    # C decides another outcome pair: nothing shares it
    c_row = {"pair": "C/0:p", "scenario": "C", "instance": "C/0", "family": "f"}
    assert D.fit_direction(stats, c_row, ("P", "Q"), "all") is None
    # within-scenario scope: the scenario's other instance only, never the pair's own
    own = D.fit_direction(stats, row, ("X", "Y"), "scenario")
    assert own.instances == ["A/1"] and own.scenarios == ["A"]
    assert torch.allclose(own.mean_old, vals["A/1"]["X"].mean(1), atol=1e-3)
    with pytest.raises(ValueError):
        D.fit_direction(stats, row, ("X", "Y"), "bogus")


def test_random_subspace_control_is_norm_matched_and_inside_its_subspace():
    g = torch.Generator().manual_seed(5)
    delta = torch.randn(6, HID, generator=g)
    u = torch.nn.functional.normalize(torch.randn(HID, generator=g), dim=0)
    rand = D.random_directions(pair_rng(1, "pair/y"), 3, HID)
    inj = D.injections(delta, u, rand)
    for k in range(3):
        sub = inj["random_subspace"][k]
        assert sub.norm() == pytest.approx(float(inj["direction"].norm()), rel=1e-5)
        # every position lies in the random one-dimensional subspace, proportional to delta's projection
        assert torch.allclose(sub, (sub @ rand[k])[:, None] * rand[k][None], atol=1e-5)
        ratio = (sub @ rand[k]) / (delta @ rand[k])
        assert torch.allclose(ratio, ratio[0].expand(6), rtol=1e-4)


def test_no_heldout_instance_in_layer_selection():
    rows = [{"pair": f"s{s}/{i}:{j}", "scenario": f"s{s}", "instance": f"s{s}/{i}", "family": "recall"}
            for s in range(3) for i in range(4) for j in range(2)]
    rows, sel, held = with_split(rows, 0.5, seed=0)
    layers = [0, 3, 6]
    for r in rows:
        r["selection_suff"] = [0.1, 0.5, 0.2] if r["split"] == "selection" else [9.0, -9.0, -9.0]
    chosen = D.choose_layers(rows, layers, ["recall", "lookup"])
    assert chosen["recall"]["layer"] == 3 and chosen["recall"]["source"] == "family"
    assert chosen["lookup"]["source"] == "all_selection" and chosen["lookup"]["layer"] == 3
    assert set(chosen["recall"]["pairs"]) and all(p.split(":")[0] in sel for p in chosen["recall"]["pairs"])
    ev = D.eval_pairs(rows, 2, 0)
    assert sum(r["pair"] in ev and r["split"] == "selection" for r in rows) == 2
    assert sum(r["pair"] in ev and r["split"] == "heldout" for r in rows) == 2
    # stratified over scenarios, then instances: a cap of 4 pairs covers the 3 scenarios and 4 instances
    ev4 = [r for r in rows if r["pair"] in D.eval_pairs(rows, 4, 0) and r["split"] == "heldout"]
    assert len(ev4) == 4 and len({r["scenario"] for r in ev4}) == 3 and len({r["instance"] for r in ev4}) == 4
    assert D.eval_pairs(rows, None, 0) == {r["pair"] for r in rows}
    assert scan_layers(30, None, 6) == [0, 6, 11, 17, 22, 28]
    assert scan_layers(4, None, None) == [0, 1, 2] and scan_layers(4, [2, 0, 2], 1) == [0, 2]
    with pytest.raises(ValueError):
        scan_layers(4, [4], None)
    # a ModelFitError (one line at the command line), naming the key; no negative index wraps around
    with pytest.raises(KvnotesError, match=r"probe.layers=\[-1, 2\]: layer \[-1\] outside the model's 4 layers"):
        scan_layers(4, [-1, 2], None)
    with pytest.raises(KvnotesError, match="give at least one layer"):
        scan_layers(4, [], None)


def test_a_layer_the_model_lacks_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    """``probe.layers=[99]`` is checked against the model's depth as soon as it is loaded, before
    any pair is run: one line, exit 2, nothing left under ``out_root`` (issue #54: it was a
    traceback). The planted model (6 layers) builds in a moment."""
    from tests.cli.test_cli import one_line_error, run_main

    def no_work(ctx):
        raise AssertionError("the probe started work")

    monkeypatch.setenv("KVNOTES_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(D, "start_circuit", no_work)
    out = tmp_path / "runs"
    proc = run_main(monkeypatch, capsys, "model=planted-notes", "scenario=planted", "probe=direction",
                    "probe.layers=[2,99]", f"out_root={out}")
    one_line_error(proc, "probe.layers=[2, 99]: layer [99] outside the model's 6 layers (0 to 5)")
    assert not out.exists() or not any(out.rglob("*"))


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny_run(request):
    model = build_tiny(request.param)
    engine = NNsightEngine(model)
    pair = synthetic_pair(model)
    run = run_pair(model, pair)
    b, d = pair.field[1], pair.decision
    pre = (kvcache.prefix_cache(model, run.old_cache, pair.old.ids, b), kvcache.prefix_cache(model, run.new_cache, pair.new.ids, b))
    layers = list(range(engine.adapter.n_layers))
    caps = [D.capture_notes(engine, ids, p, b, d, layers) for ids, p in zip((pair.old.ids, pair.new.ids), pre)]
    return model, engine, pair, run, pre, layers, caps


def test_full_difference_injection_reproduces_clean_run(tiny_run):
    model, engine, pair, run, pre, layers, ((x_old, lp_old), (x_new, lp_new)) = tiny_run
    a, b, d = pair.field[0], pair.field[1], pair.decision
    # the resumed captures score exactly like the clean runs
    assert float(first_token_scores(lp_old, pair)[0]) == pytest.approx(run.s_old, abs=1e-4)
    assert float(first_token_scores(lp_new, pair)[0]) == pytest.approx(run.s_new, abs=1e-4)
    for li in (0, len(layers) // 2):
        l = layers[li]
        delta = x_new[li] - x_old[li]
        iv = Intervention(Site("resid_post", l, range(b, d)), delta[None], mode="add")
        out = engine.run(pair.old.ids[b: d + 1], [iv], capture=[Site("resid_post", l)], cache=pre[0], start=b)
        # at layer l the note residuals become the clean (new) run's ...
        assert (out.acts[Site("resid_post", l)][0, : d - b] - x_new[li]).abs().max() < 1e-4
        # ... and only there: the field's KV above l is still old, so the score is not s_new
        # unless the field and d are patched too (then it is exactly the clean run)
        full = engine.run(pair.new.ids, capture=[Site("resid_post", l)]).acts[Site("resid_post", l)][0]
        old_full = engine.run(pair.old.ids, capture=[Site("resid_post", l)]).acts[Site("resid_post", l)][0]
        iv_all = Intervention(Site("resid_post", l, range(0, d + 1)), (full - old_full)[None], mode="add")
        s_all = float(first_token_scores(engine.run(pair.old.ids[: d + 1], [iv_all]).logprobs[:, -1], pair)[0])
        assert float(run.recovery(torch.tensor(s_all))) == pytest.approx(1.0, abs=1e-3)
        assert (full[:a] - old_full[:a]).abs().max() < 1e-5          # nothing before the field moves
        # the probe's own variants: zero addition = old run, direction + orthogonal = full
        u = torch.nn.functional.normalize(delta.mean(0), dim=0)
        inj = D.injections(delta, u, D.random_directions(pair_rng(0, "t"), 2, delta.shape[1]))
        vals = torch.stack([torch.zeros_like(delta), inj["full"], inj["direction"] + inj["orthogonal"]])
        s = D.added_scores(engine, run, pair.old.ids, pre[0], l, vals)
        assert float(s[0]) == pytest.approx(run.s_old, abs=1e-4)
        assert float(s[1]) == pytest.approx(float(s[2]), abs=1e-4)
        ref = engine.run(pair.old.ids[b: d + 1], [iv], cache=pre[0], start=b).logprobs
        assert float(s[1]) == pytest.approx(float(first_token_scores(ref[:, -1], pair)[0]), abs=1e-4)
        # necessity: after the ablation the captured note residuals of the new run project on u
        # exactly at the target mean, and everything orthogonal to u is untouched
        mu = torch.tensor([0.37])
        add = D.ablations(x_new[li], u[None], mu)
        iv_n = Intervention(Site("resid_post", l, range(b, d)), add, mode="add")
        got = engine.run(pair.new.ids[b: d + 1], [iv_n], capture=[Site("resid_post", l)], cache=pre[1],
                         start=b).acts[Site("resid_post", l)][0, : d - b].float()
        assert torch.allclose(got @ u, mu.expand(d - b), atol=1e-4)
        rest = lambda x: x - (x @ u)[:, None] * u[None]                        # noqa: E731
        assert (rest(got) - rest(x_new[li])).abs().max() < 1e-4


def _cfg(**over):
    cfg = probe_yaml("direction")
    cfg.progress = False
    cfg.n_layers_scan, cfg.max_pairs_per_family, cfg.n_boot = 2, 1, 200
    cfg.random.n_draws = 2
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


@pytest.mark.embedded
def test_run_on_embedded_model_is_finite_and_clean(smol):
    from kvnotes.harness.pairs import PairSet, prepare_pairs
    from kvnotes.probes import ProbeContext

    sc = OmegaConf.load("conf/scenario/default.yaml")
    # 3 instances: 2 selection instances per scenario, so a within-scenario fit exists for the
    # selection pairs (never on their own instance) as well as for the held-out one
    sc.families, sc.ids, sc.n_instances = ["recall"], ["favourite_colour", "home_city"], 3
    ps = prepare_pairs(smol.tokenizer, sc)
    keep, seen = [], {}
    for p in ps.pairs:                                   # one pair per instance keeps it fast
        k = p.spec.instance.id
        if seen.get(k, 0) < 1:
            keep.append(p)
            seen[k] = seen.get(k, 0) + 1
    accumulated = []
    orig = D.accumulate

    def spy(stats, row, outs, x_old, x_new):
        accumulated.append(row["pair"])
        return orig(stats, row, outs, x_old, x_new)

    mp = pytest.MonkeyPatch()
    mp.setattr(D, "accumulate", spy)
    try:
        # recall scenarios share no outcome pair, so the within-scenario fit is the one that applies
        res = D.run(ProbeContext(bundle=smol, pairs=PairSet(keep, ps.excluded, ps.scenarios),
                                 cfg=_cfg(fit_scope="scenario"), seed=0, budget_bytes=64 << 20))
    finally:
        mp.undo()
    check_schema("direction", res)
    agg = res["aggregates"]
    held = {r["pair"] for r in res["rows"] if r["split"] == "heldout"}
    assert accumulated and not held & set(accumulated)                         # fits never see held-out
    assert agg["checks"]["layer_choice_pairs_in_heldout"] == 0 and agg["checks"]["fit_pairs_in_heldout"] == 0
    assert agg["checks"]["fit_instance_equals_own"] == 0
    assert agg["checks"]["max_resume_score_error"] < 1e-3
    assert agg["checks"]["max_random_norm_rel_error"] < 1e-4 and agg["checks"]["random_k_matched"]
    assert len(agg["layers"]) == 2 and agg["n_evaluated"]["heldout"] >= 1
    assert res["warnings"] == []                              # selection, fits, held-out pairs and a chosen layer
    rows = [r for r in res["rows"] if "layers" in r]
    for r in rows:
        assert r["instance"] not in r["fit_instances"] and r["fit_scenarios"] == [r["scenario"]]
        for lv in r["layers"].values():
            vals = [lv["suff"][k] for k in D.SUFF] + [lv["nec"][k] for k in D.NEC]
            assert all(math.isfinite(v) for v in vals)
    ch = agg["at_chosen"]["suff"]["direction"]["recall"]
    assert ch["n"] >= 1 and math.isfinite(ch["mean"])
    assert np.isfinite(agg["curves"]["nec"]["random"][str(agg["layers"][0])]["all"]["mean"])


@pytest.mark.planted("direction")
def test_direction_is_the_planted_value_direction(planted_arch, planted_cache, monkeypatch):
    """Notes family: the layer chosen on the selection split is the write layer's output (layer 0,
    after which the markers hold the notes), and adding the held-out pairs' difference along the
    direction there recovers the decision (sufficiency 1 by construction). The difference-of-means
    direction fitted there has cosine at least 0.95 with the planted one (``note_<new> -
    note_<old>`` in the residual stream), for every held-out pair it is fitted for (the fits are
    read as the probe makes them)."""
    import kvnotes.circuits.direction as direction

    fits = []
    real = direction.fit_direction

    def spy(stats, row, outs, scope="all"):
        fit = real(stats, row, outs, scope)
        fits.append((outs, fit))
        return fit

    monkeypatch.setattr(direction, "fit_direction", spy)
    ctx = planted_context(planted_cache, monkeypatch, "notes", "direction", arch=planted_arch)
    agg = kvnotes.probes.get(ctx.cfg)(ctx)["aggregates"]
    truth = planted_truth(ctx)
    assert agg["chosen_layers"]["planted"]["layer"] == truth["write_heads"][0][0]
    assert agg["at_chosen"]["suff"]["direction"]["all"]["mean"] == pytest.approx(1.0, abs=BAR)
    li = agg["layers"].index(truth["write_heads"][0][0])
    assert fits and all(f is not None for _, f in fits)
    for (old, new), fit in fits:
        want = torch.zeros(planted.HIDDEN)
        want[truth["dims"][f"note_{new}"]], want[truth["dims"][f"note_{old}"]] = 1.0, -1.0
        assert float(fit.u[li] @ (want / want.norm())) >= 0.95, (old, new, float(fit.u[li] @ (want / want.norm())))
