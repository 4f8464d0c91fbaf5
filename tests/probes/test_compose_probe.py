"""The chunked scenario layout (kvnotes/harness/chunks.py) and the ``compose`` probe on the embedded model."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from kvnotes import CONF_DIR
from kvnotes.probes import ProbeContext
from tests.helpers import check_figures, probe_yaml
from types import SimpleNamespace

import torch
from kvnotes.kv.generate import Chain, token_marker
from kvnotes.harness.reader import PromptReader, Reads
from kvnotes.probes.compose.arms import read_prompts, variant_name
from kvnotes.probes.compose import aggregate, prompt_row
from tests.helpers import VOCAB, build_tiny

# fp32 on CPU: recomputing whole chunks (seam >= chunk length) is the full prefill done in three
# forwards instead of one; measured differences are ~3e-5 in logits of magnitude ~20.
FULL_SEAM_ATOL = 1e-3

pytestmark = pytest.mark.embedded


def scenario_cfg():
    sc = OmegaConf.load(os.path.join(CONF_DIR, "scenario", "default.yaml"))
    sc.families, sc.ids, sc.n_instances = ["recall"], ["home_city"], 1
    return sc


@pytest.fixture(scope="module")
def result(smol):
    from kvnotes.harness.pairs import prepare_pairs
    from kvnotes.probes.compose import run

    cfg = probe_yaml("compose")
    cfg.progress, cfg.n_boot, cfg.seams, cfg.sinks, cfg.edit_arm_seams = False, 200, [0, 4], ["bos"], [0]
    ctx = ProbeContext(bundle=smol, pairs=prepare_pairs(smol.tokenizer, scenario_cfg()), cfg=cfg, seed=0,
                       scenario_cfg=scenario_cfg())
    return run(ctx)


def test_chunk_spans_hold_the_rule_and_filler(smol):
    from kvnotes.harness.chunks import chunked_pairs

    ps = chunked_pairs(smol.tokenizer, scenario_cfg())
    assert ps.pairs and not ps.excluded
    for p in ps.pairs:
        (a1, b1), (a2, b2) = p.chunks
        assert p.chunk_names == ("rule", "filler") and b1 <= a2 and b2 <= p.field[0]
        rule = smol.tokenizer.decode(p.old.ids[a1:b1])
        assert rule.strip() == p.spec.instance.scenario.rule.strip()
        assert (p.old.ids[:p.field[0]] == p.new.ids[:p.field[0]]).all()


def test_on_a_transcript_suite_the_chunks_are_the_unrelated_tool_results(smol):
    """A transcript suite's chunked pairs precompile the unrelated exchanges' tool results, all after
    the field (which stays live); the field-in-chunk layout adds the record's tool result, which
    holds the field; and compose on it recomputing whole chunks is the full prefill."""
    from kvnotes.harness.chunks import FIELD_CHUNK_ORDER, chunked_pairs, layout_prompt
    from kvnotes.probes.compose import run

    sc = scenario_cfg()
    sc.transcript = {"turns": 2}
    tok = smol.tokenizer
    ps = chunked_pairs(tok, sc)
    assert ps.pairs and not ps.excluded
    for p in ps.pairs:
        assert p.chunk_names == ("tool_1", "tool_2") and all(a >= p.field[1] for a, _ in p.chunks)
        assert all('"result"' in tok.decode(p.old.ids[a:b]) for a, b in p.chunks)
        assert all((p.old.ids[a:b] == p.new.ids[a:b]).all() for a, b in p.chunks)
        prompt, spans = layout_prompt(tok, p.spec.instance, p.spec.old, FIELD_CHUNK_ORDER, ("rule", "context"),
                                      turns=2)
        assert torch.equal(prompt.ids, p.old.ids) and spans[1:] == p.chunks
        assert spans[0][0] <= p.field[0] and p.field[1] <= spans[0][1]          # the record's result holds the field
    cfg = probe_yaml("compose")
    # the whole-chunk seam and the edit arms; no controls (they run on the default suite's record,
    # test_embedded_compose_record): what is the transcript's own is the chunking
    cfg.progress, cfg.n_boot, cfg.seams, cfg.sinks, cfg.edit_arm_seams, cfg.controls = False, 50, [10_000], ["bos"], [0], False
    res = run(ProbeContext(bundle=smol, pairs=ps, cfg=cfg, seed=0, scenario_cfg=sc))
    assert res["aggregates"]["checks"]["max_abs_logit_diff_full_seam"] < FULL_SEAM_ATOL
    assert res["aggregates"]["n_prompts"] == 3
    assert all("excluded" not in arm for r in res["rows"] for arm in r["arms"].values())


def test_embedded_compose_record(result, tmp_path):
    agg = result["aggregates"]
    assert agg["checks"]["max_abs_logit_diff_full_seam"] < FULL_SEAM_ATOL
    names = result["variant_names"]
    assert set(names) == {f"{r}/sink=bos/seam={s}" for r in ("rotate", "no_rotate") for s in (0, 4)}
    assert agg["n_prompts"] == len(result["prompts"]) == 3          # 3 field values, 1 instance
    assert len({p["prompt"] for p in result["prompts"]}) == 3          # each distinct prompt read once
    for v in names:
        da = agg["variants"][v]["decision_agreement"]["all"]
        assert da["n"] == agg["n_owned_prompts"]
        assert 0 <= agg["variants"][v]["kl"]["all"]["mean"]
    assert len(result["rows"]) == 3 and all(len(r["s_full"]) == 2 for r in result["rows"])
    check_figures("compose", result, tmp_path)


def test_composition_controls_compare_the_composed_run_with_the_full_one(result):
    """The referee's controls (docs/probes/compose.md): the residual entering layer 0 is the token
    embedding, identical in both runs at every position; deeper, the composed positions (computed
    behind their sink only) differ from the full run's, and each composed position's query saw
    less than its whole causal context. The control's composed decision is the probe's own
    (rotate, seam 0) variant's."""
    c = result["aggregates"]["controls"]
    assert c["check_abs_logprob_diff"] < 1e-4
    bos = c["sink=bos"]
    for where in ("composed positions", "computed positions"):
        assert bos[where]["rel_l2"][0]["mean"] == pytest.approx(0.0, abs=1e-6)
        assert bos[where]["cosine"][0]["mean"] == pytest.approx(1.0, abs=1e-6)
    last = max(bos["composed positions"]["rel_l2"])
    assert bos["composed positions"]["rel_l2"][last]["mean"] > 1e-3
    assert 0.0 < bos["context_seen"]["mean"] < 1.0


def test_edit_arms_are_judged_against_the_edited_text(result):
    arms = result["aggregates"]["edit_arms"]
    for arm, keys in (("erratum", ("composed/seam=0", "full")), ("field_in_chunk", ("refreshed/seam=0", "stale/seam=0"))):
        assert arms[arm]["n"] + arms[arm]["excluded"] == len(result["rows"])
        for k in keys:
            assert arms[arm][k]["accuracy"]["n"] == arms[arm]["n"]
    # the refreshed field must move the decision towards the oracle: KL no larger than the stale cache's
    fic = arms["field_in_chunk"]
    if fic["n"]:
        assert fic["refreshed/seam=0"]["kl"]["mean"] <= fic["stale/seam=0"]["kl"]["mean"] + 1e-6


def test_edit_arms_shared_work_equals_each_pair_alone(smol, result):
    """The probe shares work between an instance's pairs (precompiled chunks, the erratum oracle from
    the composed prompts' full prefill, one stale cache per old value); each pair's arms must equal
    the arms computed for that pair alone, from scratch."""
    from kvnotes.harness.chunks import chunked_pairs
    from kvnotes.probes.compose.arms import edit_arms

    ps = chunked_pairs(smol.tokenizer, scenario_cfg())
    for pair, row in zip(ps.pairs, result["rows"]):
        assert row["pair"] == pair.spec.id
        alone = edit_arms(smol.model, smol.tokenizer, pair, [0], {})
        for arm, methods in (("erratum", ("composed", "full")), ("field_in_chunk", ("refreshed", "stale"))):
            got, want = row["arms"][arm], alone[arm]
            assert got.keys() == want.keys() and got["oracle_top1"] == want["oracle_top1"]
            for m in methods:
                assert got[m]["top1_agree"] == want[m]["top1_agree"]
                assert got[m]["kl"] == pytest.approx(want[m]["kl"], abs=FULL_SEAM_ATOL)


# -------------------- the generated readout (scenario.variant=cot)
# ``compose`` under chain of thought (``scenario.variant=cot``): with zero new tokens the generated
# readout of the full prefill and of every composed variant is the direct readout
# (:func:`kvnotes.probes.compose.arms.read_prompts` under either :class:`kvnotes.harness.reader.PromptReader`); a composed variant whose seam recomputes whole chunks
# generates the full prefill's chain token for token; a chain without its marker is excluded (full
# chain) or counted unreached (composed chain), never scored; ``run.py`` writes a generated-readout
# record on the embedded model.

#: fp32 on CPU: the cut prompt composed on a dynamic cache and the last token fed by the decoder vs
#: the whole prompt composed in one call (static cache on full-attention models): the same
#: computation in other forwards and batch shapes, ~1e-6 measured; a wrong position, seam or fed
#: token moves log-probs by far more than this.
TOL = 1e-4
L = 30
CHUNKS = ((3, 10), (11, 19))          # longer than the sliding window (8): windows fill inside a chunk
FIELD = (21, 24)
VARIANTS = [(rot, sink, seam) for rot in (True, False) for sink in ("none", "bos", "prefix") for seam in (0, 3)]
WHOLE = [(True, "bos", 99), (False, "none", 99)]       # seam >= every chunk: whole chunks recomputed
COLS = {"prompt": "i:v", "scenario": "s", "family": "f", "instance": "i", "value": "v"}


def _ids(seed: int = 5) -> torch.Tensor:
    """Two prompts ``[2, L]`` that differ only inside FIELD (after the chunks)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, VOCAB, (L,), generator=g)
    new = old.clone()
    new[FIELD[0]:FIELD[1]] = (old[FIELD[0]:FIELD[1]] + 1 + torch.randint(0, VOCAB - 1, (3,), generator=g)) % VOCAB
    return torch.stack([old, new])


def _reader(model, readout: str = "direct", max_new: int = 0, marker=None) -> PromptReader:
    return PromptReader(readout, model, None, max_new, marker)


def test_zero_new_tokens_is_the_direct_readout(tiny):
    ids = _ids()
    gen = read_prompts(tiny, _reader(tiny, "generated"), ids, CHUNKS, VARIANTS)
    direct = read_prompts(tiny, _reader(tiny), ids, CHUNKS, VARIANTS)
    for res, ref in zip(gen, direct):
        full = res["full"]
        assert full.reached(0) and full.chains[0].length == 0 and ref["full"].chains is None
        assert float((full.logprobs - ref["full"].logprobs).abs().max()) < TOL
        expected = int(ref["full"].logprobs[0].argmax())
        row, want = prompt_row(_reader(tiny, "generated"), COLS, res, expected), prompt_row(_reader(tiny), COLS, ref, expected)
        assert "reason" not in row and row["owned"] and want["owned"]
        assert "max_abs_logit_diff_full_seam" in want and "max_abs_logit_diff_full_seam" not in row
        for v in VARIANTS:
            name = variant_name(*v)
            c = res["variants"][name]
            assert c.reached(0) and c.chains[0].length == 0
            assert float((c.logprobs - ref["variants"][name].logprobs).abs().max()) < TOL, name
            got, exp = row["variants"][name], want["variants"][name]
            assert got["top1_agree"] == exp["top1_agree"] and got["top1"] == exp["top1"] and got["same_chain"]
            assert got["kl"] == pytest.approx(exp["kl"], abs=TOL)
            assert "logit_cosine" in exp and "logit_cosine" not in got and "chain" not in exp


def test_whole_chunk_seam_generates_the_full_chain(tiny):
    ids = _ids(7)
    n = 6
    reader = _reader(tiny, "generated", 10, lambda t: len(t) >= n)
    gen = read_prompts(tiny, reader, ids, CHUNKS, WHOLE + [(False, "none", 0)])
    for res in gen:
        row = prompt_row(reader, COLS, res, 0)
        assert row["full_chain"]["reached"] and row["full_chain"]["marker_at"] == n - 1
        for v in WHOLE:
            name = variant_name(*v)
            assert row["variants"][name]["same_chain"], name
            assert row["variants"][name]["kl"] < TOL
            assert float((res["variants"][name].logprobs - res["full"].logprobs).abs().max()) < TOL
        ctrl = row["variants"]["no_rotate/sink=none/seam=0"]       # decoded and read like any other variant
        assert ctrl["reached"] and ctrl["chain"]["length"] == n and ctrl["kl"] is not None


def test_a_chain_without_its_marker_is_never_scored():
    model = build_tiny("llama")
    ids = _ids()
    reader = _reader(model, "generated", 3, token_marker([VOCAB + 5]))          # never generated
    for res in read_prompts(model, reader, ids, CHUNKS, VARIANTS[:2]):
        assert res["variants"] == {}                               # the prompt is not composed
        row = prompt_row(reader, COLS, res, 0)
        assert row["reason"] == "full_no_marker" and row["full_chain"]["length"] == 3
        assert "owned" not in row and "variants" not in row
    # a composed chain that misses its marker: counted per variant, out of that variant's metrics
    lp = torch.log_softmax(torch.randn(VOCAB), -1)[None]
    res = {"full": Reads(lp, [Chain([1, 2], True, "marker")]),
           "variants": {"a": Reads(lp, [Chain([1, 2], True, "marker")], unreached=[None]),
                        "b": Reads(torch.full_like(lp, float("nan")), [Chain([1, 3, 4], False, "max_new_tokens")],
                                   unreached=["composed_no_marker"])}}
    row = prompt_row(reader, COLS, res, int(lp.argmax()))
    b = row["variants"]["b"]
    assert not b["reached"] and b["kl"] is None and b["top1_agree"] is None and b["top1"] is None
    assert b["unreached_reason"] == "composed_no_marker" and not b["same_chain"]
    agg = aggregate([row], [], ["a", "b"], ["f"], 50, 0, readout="generated")
    assert agg["b"]["n_unreached"]["all"] == 1 and agg["b"]["decision_agreement"]["all"]["n"] == 0
    assert agg["b"]["kl"]["all"]["n"] == 0 and (agg["b"]["same_chain"]["all"]["k"], agg["b"]["same_chain"]["all"]["n"]) == (0, 1)
    assert agg["a"]["decision_agreement"]["all"]["k"] == 1 and agg["a"]["kl"]["all"]["mean"] == pytest.approx(0.0, abs=1e-6)
    assert "logit_cosine" not in agg["a"]


@pytest.mark.parametrize("seed", range(3))
def test_screened_pairs_are_read_in_suite_order(seed):
    """The generated screen hands pairs over round-robin over scenarios; compose reads an instance's
    prompts once, with its pairs one after another, so it puts them back in suite order (rows with them)."""
    import random

    from kvnotes.probes.compose import suite_order

    suite = [SimpleNamespace(name=f"{inst}:{k}") for inst in "abc" for k in range(3)]
    picked = random.Random(seed).sample(suite, 6)
    pr = SimpleNamespace(pairs=[SimpleNamespace(pair=p) for p in picked], rows=[{"pair": p.name} for p in picked])
    pairs, rows = suite_order(suite, pr)
    assert [p.name for p in pairs] == [p.name for p in suite if p in picked] == [r["pair"] for r in rows]


def test_image_chunk_is_refused_under_cot_before_the_model_loads():
    """The image arm reads the decision position directly: ``image_chunk: true`` under
    ``scenario.variant=cot`` is one line from the run's checks (``Config.DIRECT_ONLY``), and the
    default is not refused."""
    from kvnotes.errors import KvnotesError
    from kvnotes.harness.registry import check_run, load_config
    from kvnotes.harness.runconfig import RunSettings

    cot = RunSettings.model_validate({"out_root": "runs", "model": {"name": "m"}, "scenario": {"variant": "cot"}})
    with pytest.raises(KvnotesError, match="probe.image_chunk=true is not run under scenario.variant=cot .*"
                                           "set probe.image_chunk=false") as err:
        check_run(load_config("compose", {"image_chunk": True}), cot)
    assert "\n" not in str(err.value)
    check_run(load_config("compose"), cot)


@pytest.mark.embedded
def test_run_py_writes_a_generated_compose_record(gemma, tmp_path):
    """On Gemma-3-270M: its favourite_colour chains reach "colour is", so the record has kept
    prompts and pairs (on SmolLM2-135M no full chain of the chunked layout reaches its marker,
    measured: its record would hold only exclusions, the branch the tiny tests above check)."""
    from kvnotes.plots import plot_record
    from kvnotes.records.tables import record_table
    from tests.helpers import job_record

    rec = job_record(gemma, tmp_path, "model=gemma-3-270m", "probe=compose", "scenario=small", "scenario.variant=cot",
                     "scenario.n_instances=1", "scenario.ids=[favourite_colour]", "probe.cot_max_pairs=1",
                     "probe.cot_seams=[0]", "probe.sinks=[bos]", "probe.n_boot=50", "plot=false")
    res = rec["result"]
    agg, ex = res["aggregates"], res["exclusions"]
    names = res["variant_names"]
    assert agg["readout"] == "generated" and agg["edit_arms"] is None and agg["edit_arms_note"]
    assert names == ["rotate/sink=bos/seam=0", "no_rotate/sink=bos/seam=0"]
    assert agg["n_screened"] == 1 and ex.get("beyond_max_pairs", 0) == agg["n_aligned"] - 1
    # the pair: excluded by the screen's clean chains, or measured; then its two prompts read, each kept
    # or excluded by its full chain, and the pair kept only with both
    n_rows = agg["checks"]["n_rows"]
    assert n_rows + ex.get("old_no_marker", 0) + ex.get("new_no_marker", 0) == 1
    assert agg["n_prompts_screened"] == 2 * agg["n_reached"] == agg["n_prompts"] + sum(agg["prompt_exclusions"].values())
    assert (n_rows == 1) == (agg["n_prompts"] == 2)
    assert res["prompts"] and res["rows"]              # the kept branch is exercised, not only exclusions
    for r in res["excluded"]:
        if r["reason"].startswith("full_"):
            assert not r["full_chain"]["reached"] and r["full_chain"]["length"] == len(r["full_chain"]["ids"])
    for p in res["prompts"]:
        assert p["full_chain"]["reached"] and p["full_chain"]["marker_at"] == p["full_chain"]["length"] - 1
        assert p["full_text"].rstrip(" ").endswith("colour is")
        for v in names:
            d = p["variants"][v]
            assert len(d["chain"]["ids"]) == d["chain"]["length"] and (d["kl"] is None) != d["reached"]
    for v in names:
        a = agg["variants"][v]
        done = [p for p in res["prompts"] if p["variants"][v]["reached"]]
        assert a["n_unreached"]["all"] == len(res["prompts"]) - len(done) == agg["n_unreached"][v]
        assert a["decision_agreement"]["all"]["n"] == sum(p["owned"] for p in done)
        assert a["same_chain"]["all"]["n"] == agg["n_prompts"]
    assert agg["n_flip"] == sum(r["flips"] for r in res["rows"]) and ex.get("no_cot_flip", 0) == n_rows - agg["n_flip"]
    assert "generated" in record_table(rec) and plot_record(rec, tmp_path)     # table and figure from the record
