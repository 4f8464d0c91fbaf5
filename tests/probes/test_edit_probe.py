"""The ``edit`` probe end to end on the embedded model, the prompt edits of kvnotes.harness.edit_prompts, and the
CoT decision reader; on the planted constructions the in-place refresh fails where the notes decide, selective
recompute recovers, and no erratum wording can matter."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import kvnotes.probes
from kvnotes.harness.selection import round_robin
from kvnotes.models import planted
from tests.helpers import check_figures, recall_pairs, probe_yaml
from tests.planted import EXACT, planted_context, planted_truth

# fp32 CPU: K=0 selective and the field refresh are the same cache; the KL of the same
# distribution computed twice is rounding only.
KL_TOL = 1e-5
#: A recall scenario whose cot pair SmolLM2 flips by generation (both chains reach the marker).
COT_SCENARIO = "favourite_colour"


def test_generated_readout_at_zero_new_tokens_is_the_direct_readout(tiny, monkeypatch):
    """The readout hook of cache probes (:func:`kvnotes.harness.protocol.read_caches`): with no
    token generated, the generated readout reads each cache's decision where the direct one does
    (same log-probs and scores, caches grouped by position and token); its side is the owned top-1
    (None when the top-1 is neither candidate), the direct one's the score's sign."""
    from types import SimpleNamespace

    from kvnotes.harness import kit
    from kvnotes.harness.protocol import read_caches
    from kvnotes.kv.cache import AllSlotCache
    from tests.helpers import cot_tiny_ctx
    from tests.kv.test_cache import prompts
    from tests.probes.test_injection import synthetic_pair

    monkeypatch.setattr(kit, "cot_marker", lambda ctx, pair: None)
    old, new = prompts()
    pair = synthetic_pair(old, new)
    d = pair.decision
    items = {name: (AllSlotCache.prefill(tiny, ids[:pos]), pos, int(ids[pos]))
             for name, ids, pos in (("old", old, d), ("new", new, d), ("short", old, d - 1), ("new_short", new, d - 1))}
    reads = {}
    for variant in ("direct", "cot"):
        ctx = cot_tiny_ctx(tiny, monkeypatch)
        ctx.scenario_cfg, ctx.cfg, ctx.budget_bytes = {"variant": variant}, SimpleNamespace(cot_max_new_tokens=0), 1 << 30
        reads[variant] = read_caches(ctx, pair, items)
    owned = {pair.cand_old[0]: "old", pair.cand_new[0]: "new"}
    for name in items:
        direct, gen = reads["direct"][name], reads["cot"][name]
        assert torch.allclose(gen.logprobs, direct.logprobs, atol=KL_TOL) and gen.s == pytest.approx(direct.s, abs=KL_TOL)
        assert direct.side == ("new" if direct.s > 0 else "old") and direct.chain is None and direct.reached
        assert gen.side == owned.get(int(gen.logprobs.argmax())) and gen.reached and gen.chain.length == 0
    assert list(reads["cot"]) == list(items)
    with torch.no_grad():                       # and each is the cache's own next-token distribution
        lp = torch.log_softmax(tiny(input_ids=old[None, : d + 1]).logits[0, -1].float(), -1)
    assert torch.allclose(reads["direct"]["old"].logprobs, lp, atol=KL_TOL)


def test_round_robin_keeps_every_scenario():
    rows = [{"scenario": s} for s in "aaabbc"]
    assert [rows[i]["scenario"] for i in round_robin(rows)][:3] == ["a", "b", "c"]


def _swept_row(scenario: str, instance: int, split: str, agree: bool | None, swept: bool = True) -> dict:
    sweep = {} if agree is None else {f"selective_{n}@{k}": {"agree": agree if n == "last" else not agree}
                                      for n in ("last", "random") for k in (0, 4)}
    return {"scenario": scenario, "instance": f"{scenario}/{instance}", "split": split, "swept": swept, "sweep": sweep}


def test_the_sweep_takes_both_sides_of_the_split():
    """The K sweep's cap takes selection and held-out pairs in turn (each side round-robin over
    scenarios): a cap that kept the first pairs of each scenario kept one side only, and the ranking
    choice had nothing to choose on (issue #54: ``ranking_choice.chosen=null``)."""
    from kvnotes.harness.selection import alternate_splits

    rows = [{"scenario": s, "split": sp} for s, sp in zip("abcdab", ["heldout"] * 4 + ["selection"] * 2)]
    order = round_robin(rows)
    assert alternate_splits(rows, order) == [4, 0, 5, 1, 2, 3]
    assert alternate_splits(rows, order)[:2] == [4, 0]                   # a cap of two: one of each side


def test_the_ranking_choice_states_why_nothing_was_chosen():
    """The ranking is chosen on swept selection pairs and its curve reported on swept held-out ones;
    when nothing can be chosen, ``reason`` says why (and the probe warns), never a bare null."""
    from kvnotes.probes.edit import choose_ranking

    rows = [_swept_row("a", 0, "selection", True), _swept_row("a", 1, "heldout", False),
            _swept_row("b", 0, "heldout", True)]
    got = choose_ranking(rows, ["random", "last"], [0, 4])
    assert got["chosen"] == "last" and got["reason"] is None and got["n_swept"] == {"selection": 1, "heldout": 2}
    assert got["held_out"]["last"]["4"]["n"] == 2 and got["held_out"]["last"]["4"]["k"] == 1
    one = [r | {"split": "heldout"} for r in rows]
    assert choose_ranking(one, ["last"], [0, 4], n_instances=1)["reason"].startswith("scenario.n_instances=1: every instance is held out")
    assert "no edited pair is on a selection instance" in choose_ranking(one, ["last"], [0, 4], n_instances=4)["reason"]
    unswept = [rows[0] | {"swept": False}, *rows[1:]]
    assert "the K sweep ran on no selection pair" in choose_ranking(unswept, ["last"], [0, 4])["reason"]
    too_short = [rows[0] | {"sweep": {}}, *rows[1:]]
    assert "every K of probe.ks exceeds" in choose_ranking(too_short, ["last"], [0, 4])["reason"]
    assert "probe.rankings is empty" in choose_ranking(rows, [], [0, 4])["reason"]
    # a result's warnings are said on stderr by the job, one line each
    from kvnotes.harness.jobs import warning_lines

    assert warning_lines({"warnings": ["edit: no ranking\nchosen"]}) == ["kvnotes: warning: edit: no ranking chosen"]
    assert warning_lines({}) == []


def test_one_instance_runs_and_says_why_no_ranking_is_chosen(tmp_path, monkeypatch, capsys):
    """``scenario.n_instances=1`` holds every instance out: the edit methods still run (the split is
    not their point), and the record's ``ranking_choice.reason`` and ``warnings`` and one stderr line
    say why no ranking was chosen (issue #54: a bare ``chosen=null``). The planted model builds in
    a moment."""
    import json

    from tests.cli.test_cli import run_main

    monkeypatch.setenv("KVNOTES_CACHE", str(tmp_path / "cache"))
    proc = run_main(monkeypatch, capsys, "model=planted-notes", "scenario=planted", "probe=edit", "scenario.n_instances=1",
                    "plot=false", "probe.progress=false", "probe.n_boot=50", f"out_root={tmp_path / 'runs'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (path,) = (tmp_path / "runs").rglob("record.json")
    res = json.loads(path.read_text())["result"]
    choice = res["aggregates"]["ranking_choice"]
    assert choice["chosen"] is None and choice["reason"].startswith("scenario.n_instances=1: every instance is held out")
    assert choice["n_swept"]["selection"] == 0 and choice["n_swept"]["heldout"] > 0
    assert res["warnings"] == [f"edit: no ranking chosen for the K sweep: {choice['reason']}"]
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("kvnotes: warning:")] == \
        [f"kvnotes: warning: {res['warnings'][0]}"]


@pytest.mark.embedded
def test_prompt_edits_align_with_the_cached_prompt(smol):
    from kvnotes.harness import edit_prompts as edits

    pair = recall_pairs(smol, ["home_city"], 1).pairs[0]
    inst, tok = pair.spec.instance, smol.tokenizer
    same = edits.edited_prompt(tok, inst, pair.spec.old, pair.old)
    assert torch.equal(same.prompt.ids, pair.old.ids)
    notice = edits.erratum_text(inst, pair.spec.new)
    err = edits.edited_prompt(tok, inst, pair.spec.old, pair.old, notice=notice)
    assert notice in err.prompt.text and err.prompt.text.index(notice) < err.prompt.text.index(inst.scenario.request)
    assert pair.field[1] <= err.reuse < pair.old.decision
    assert torch.equal(err.prompt.ids[: err.reuse], pair.old.ids[: err.reuse])
    old_h, new_h = edits.hoisted_pair(tok, inst, pair.spec.old, pair.spec.new)
    assert new_h.reuse == old_h.field[0]                          # reuse ends where the field starts
    assert len(old_h.ids) - new_h.reuse < len(pair.old.ids) - pair.field[0]
    irr = edits.length_matched_notice(tok, edits.notice_tokens(tok, notice))
    assert abs(edits.notice_tokens(tok, irr) - edits.notice_tokens(tok, notice)) <= 2


@pytest.mark.embedded
@pytest.mark.parametrize("variant", ["direct", "cot"])
def test_edit_probe_end_to_end(smol, tmp_path, variant):
    """One probe, both readouts: every method's cache read at the decision position, or after its
    generated chain's answer marker (``scenario.variant=cot``); full agrees with itself, stale does
    not, a chain that missed its marker is neither scored nor agreeing, and the figures render."""
    import kvnotes.probes

    from kvnotes.harness.pairs import PairSet

    cot = variant == "cot"
    full_set = recall_pairs(smol, [COT_SCENARIO if cot else "home_city"], 1, variant=variant)
    pairs = PairSet(full_set.pairs[:1], [], full_set.scenarios)          # one pair keeps the test short
    cfg = probe_yaml("edit")
    cfg.update({"ks": [0, 4], "cot_ks": [0, 4], "rankings": ["last"], "oracle_ranking": "last", "max_pairs": 1,
                "sweep_max_pairs": 1, "max_control_pairs": 1, "n_boot": 100, "progress": False,
                "cot_max_new_tokens": 12})               # its clean chains reach the marker in 7 tokens
    sc = OmegaConf.create({"variant": variant, "chat_template": True})
    res = kvnotes.probes.get("edit")(kvnotes.probes.ProbeContext(bundle=smol, pairs=pairs, cfg=cfg, scenario_cfg=sc))
    agg = res["aggregates"]
    assert agg["n_flip"] == len(res["rows"]) == 1 and not res["exclusions"]
    for r in res["rows"]:
        m = r["methods"]
        assert m["full"]["agree"] and m["full"]["kl"] == 0.0 and m["full"]["frac"] == 1.0 and m["full"]["top1"]
        assert not m["stale"]["agree"] and m["stale"]["tokens"] == 0
        assert m["refresh_field"]["tokens"] == r["field"][1] - r["field"][0]
        assert 0 < m["erratum"]["tokens"] < m["full"]["tokens"]
        for got in [*m.values(), *r["sweep"].values()]:
            assert (got["s"] is None) == (got["r"] is None) == (got["kl"] is None) == (not got.get("reached", True))
            assert got["reached"] or not got["agree"] if cot else "reached" not in got
    swept = [r for r in res["rows"] if r["swept"]]
    assert len(swept) == 1
    s = swept[0]
    assert set(s["sweep"]) == {"selective_last@0", "selective_last@4"} | (set() if cot else {"oracle_copy@0", "oracle_copy@4"})
    if s["sweep"]["selective_last@0"]["reached"] if cot else True:
        assert s["sweep"]["selective_last@0"]["s"] == pytest.approx(s["methods"]["refresh_field"]["s"], abs=KL_TOL)
    assert agg["upper_bounds"] == ([] if cot else ["oracle_copy"])
    assert set(agg["controls"]) == {"wrong_erratum", "irrelevant_notice", "overcorrection"}
    # one instance: nothing to choose a ranking on, and the record says why
    choice = agg["ranking_choice"]
    assert choice["chosen"] is None and "no edited pair is on a selection instance" in choice["reason"]
    assert res["warnings"] == [f"edit: no ranking chosen for the K sweep: {choice['reason']}"]
    if cot:
        assert agg["readout"] == "generated" and agg["n_screened"] == 1 and not res["control_rows"]
        assert r["chain_old"]["reached"] and r["chain_new"]["reached"]
        assert agg["methods"]["full"]["agreement"]["all"]["p"] == 1.0 and agg["methods"]["full"]["reached_marker"]["p"] == 1.0
    else:
        assert s["sweep"]["oracle_copy@4"]["flops_frac"] is None                    # upper bound: no cost
        assert abs(s["sweep"]["selective_last@0"]["kl"] - s["methods"]["refresh_field"]["kl"]) < KL_TOL
    check_figures("edit", res, tmp_path)


def test_the_chosen_ranking_gets_a_verdict_against_the_random_ranking():
    """Issue #53: beside the ranking chosen on selection instances, the record states whether it beats
    the random ranking on the swept held-out pairs (recovery averaged over K)."""
    from kvnotes.probes.edit import ranking_verdict

    rows = []
    for s in ("a", "b"):
        for i in range(3):
            sweep = {f"selective_{n}@{k}": {"r": v + 0.01 * i, "agree": True}
                     for n, v in (("attention", 0.9), ("random", 0.2)) for k in (1, 4)}
            rows.append({"pair": f"{s}/{i}:x", "scenario": s, "instance": f"{s}/{i}", "family": "f",
                         "split": "heldout", "swept": True, "sweep": sweep})
    got = ranking_verdict(rows, {"chosen": "attention"}, [1, 4], ["f"], 200, 0)
    cell = got["ranking"]["by_family"]["f"]
    assert cell["verdict"] == "supported" and cell["difference"]["mean"] == pytest.approx(0.7)
    assert "attention ranking" in got["ranking"]["claim"]
    assert ranking_verdict(rows, {"chosen": None}, [1, 4], ["f"], 200, 0) == {}
    assert ranking_verdict(rows, {"chosen": "random"}, [1, 4], ["f"], 200, 0) == {}


# --- the planted constructions (tests/planted.py) -------------------------------------------------


@pytest.mark.planted("edit")
@pytest.mark.parametrize("family,alpha", [("notes", 0.0), ("mixed", 0.3), ("mixed", 0.7), ("direct", 1.0)])
def test_edit_refresh_fails_where_the_notes_decide_and_selective_recompute_recovers(planted_arch, planted_cache,
                                                                                     monkeypatch, family, alpha):
    if planted_arch == "gemma3" and family != "mixed":
        pytest.skip("Gemma-3: the mixed family's two sides of alpha = 0.5 (the others run on Llama)")
    """The in-place field refresh moves exactly the share the model reads from the field (recovery
    ``alpha``) and so decides like the full re-prefill exactly where ``alpha > 0.5``; recomputing
    one downstream position, ranked by attention or by first-layer K/V deviation, recomputes the
    planted note and recovers the decision. The erratum (the new value restated before the request)
    recovers ``alpha / 2``: the direct read head splits its attention between the two field tokens
    and the notes keep the old value.

    What the attention ranking cannot see, on Gemma-3: it averages the decision's attention over
    every layer and head, and the heads that read nothing in the sliding-window layers spread theirs
    over the window, so the ``W - 1`` positions before the decision outrank the one note, which
    ranks ``W``-th (``W`` the window): recomputing ``W - 1`` positions leaves the edit at ``alpha``,
    ``W`` recover it. The K/V-deviation ranking finds the note first on both."""
    window = planted.SLIDING_WINDOW
    ctx = planted_context(planted_cache, monkeypatch, family, "edit", {"planted": {"alpha": alpha}},
                          {"ks": [0, 1, window - 1, window], "rankings": ["attention", "kv_deviation"],
                           "oracle_ranking": None, "max_control_pairs": 0, "sweep_max_pairs": None},
                          n_instances=1, scenario_ids=["adjacent"], arch=planted_arch)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    truth = planted_truth(ctx)
    assert res["rows"] and truth["notes"]["weights"] == [1.0]          # one note position
    note_rank = {"attention": truth.get("sliding_window", 1), "kv_deviation": 1}
    for r in res["rows"]:
        m = r["methods"]
        assert m["refresh_field"]["r"] == pytest.approx(alpha, abs=EXACT) and m["refresh_field"]["agree"] == (alpha > 0.5)
        assert m["erratum"]["r"] == pytest.approx(alpha / 2, abs=EXACT)
        for ranking, rank in note_rank.items():
            for k in (0, 1, window - 1, window):
                want = 1.0 if k >= rank else alpha
                assert r["sweep"][f"selective_{ranking}@{k}"]["r"] == pytest.approx(want, abs=EXACT), (ranking, k)


def test_erratum_wording_cannot_matter_where_only_the_value_is_read(planted_arch, planted_cache, monkeypatch):
    """``probe.erratum_wordings`` runs the registry's erratum with each wording (issue #52). The planted
    model reads role words only (every other word is ``<unk>``), so every wording is the new value
    plus words it cannot read: each recovers the construction's ``alpha / 2`` (the field read head
    splits its attention between the stale field and the erratum's value; the notes are never
    re-read), and none takes the decision at ``alpha`` 0.3."""
    from kvnotes.context import ERRATUM_WORDINGS

    ctx = planted_context(planted_cache, monkeypatch, "mixed", "edit", {"planted": {"alpha": 0.3}},
                          {"erratum_wordings": list(ERRATUM_WORDINGS), "ks": [], "rankings": [], "oracle_ranking": None,
                           "max_control_pairs": 0, "sweep_max_pairs": 0}, ["adjacent"], n_instances=1,
                          arch=planted_arch)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    got = res["aggregates"]["wordings"]
    assert list(got) == list(ERRATUM_WORDINGS) and res["rows"]
    for wording, m in got.items():
        rec = m["recovery"]["all"]
        assert rec["n"] == len(res["rows"]) and rec["mean"] == pytest.approx(0.15, abs=2e-3), wording
        assert rec["decision_flipped"]["k"] == 0
    assert all(abs(r["wordings"][w]["r"] - 0.15) < 2e-3 for r in res["rows"] for w in ERRATUM_WORDINGS)
