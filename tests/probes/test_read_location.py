"""read_location: decision-row attention masses match eager attention (incl. Gemma-2 soft-capping and
sliding windows), knockouts hide exactly the chosen keys, knocking out nothing changes nothing, the
probe runs on the embedded model, and on the planted constructions its knockouts move the planted shares."""

from __future__ import annotations

import json

import copy
import sys
from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

import kvnotes.probes
from kvnotes.kv import cache as kvcache
from kvnotes.models.adapters import Adapter
from kvnotes.kv.capture import attention_hook
from kvnotes.harness.pairs import prepare_pairs
from kvnotes.probes import ProbeContext
from kvnotes.harness.kit import layer_bands
from kvnotes.harness.readout import collapse_flags
from kvnotes.kv.knockout import GROUPS, DecisionRowHook, decision_forward, group_masses, key_groups, knockout_masks
from kvnotes.probes.read_location import run as run_read_location
from tests.helpers import ARCHS, VOCAB, WINDOW, build_tiny, check_figures, probe_yaml
from kvnotes.kv.generate import token_marker
from kvnotes.kv.knockout import generate_knocked
from kvnotes.kv.knockout import CHAIN_GROUPS, chain_spans
from tests.helpers import job_record
from kvnotes.models import planted
from tests.planted import BAR, planted_context, planted_truth

T = 3 * WINDOW            # prefix length (longer than the sliding window)
FIELD = (5, 8)
SHARPEN = 400.0           # multiplies every attention module's scaling so attention is far from uniform
MILD = 10.0               # sharpening for knockout tests: peaked, but every key keeps some mass
TOL = 1e-5


def sharpened(arch: str, softcap: float | None = None, factor: float = SHARPEN):
    model = build_tiny(arch)
    for layer in model.model.layers:
        layer.self_attn.scaling *= factor
        if softcap is not None:
            layer.self_attn.attn_logit_softcapping = softcap
    return model


def eager_reference(model, ids: torch.Tensor) -> torch.Tensor:
    """Head-mean attention of the last position, per layer ``[L, T + 1]``, from an eager copy's
    full forward with ``output_attentions``."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    with torch.no_grad():
        out = ref(ids[None], position_ids=torch.arange(len(ids))[None], output_attentions=True)
    return torch.stack([a[0, :, -1, :].mean(0) for a in out.attentions])


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (T + 1,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_masses_match_eager_attention_and_sum_to_one(arch):
    model = sharpened(arch)
    x = ids()
    read = decision_forward(model, kvcache.prefill(model, x[:T]), x[T:], capture=True)
    ref = eager_reference(model, x)
    probs = read.probs[0]                                                   # [L, T + 1]
    assert probs.shape == ref.shape == (model.config.num_hidden_layers, T + 1)
    assert torch.allclose(probs, ref, atol=TOL)
    assert read.recon_err < TOL                                             # eager probs reproduce the executed output
    groups = key_groups(FIELD, T, 1)
    masses = group_masses(probs, groups)
    assert torch.allclose(masses.sum(-1), torch.ones(len(masses)), atol=TOL)
    # far from uniform over the visible keys in every layer (guards against a vacuous match):
    # total-variation distance from the uniform distribution
    visible = (ref > 0).float()
    assert float((0.5 * (probs - visible / visible.sum(-1, keepdim=True)).abs().sum(-1)).min()) > 0.15
    if arch in ("mistral", "gemma2", "gemma3"):                            # sliding layers see only the window
        sliding = [i for i, t in enumerate(Adapter.for_model(model).layer_types) if t == "sliding_attention"]
        assert sliding and float(probs[sliding, : T + 1 - WINDOW].abs().max()) == 0.0


def test_gemma2_softcap_matters_and_positional_call_would_be_uniform():
    """Gemma-2 soft-caps attention logits and orders (dropout, scaling) unlike Llama: the masses must
    match eager attention *with* the cap, a model without the cap must give different masses, and a
    Llama-order positional call must give ~uniform attention (the trap our keyword call avoids)."""
    model = sharpened("gemma2", softcap=2.0)
    x = ids(2)
    cache = kvcache.prefill(model, x[:T])
    read = decision_forward(model, cache, x[T:], capture=True)
    ref = eager_reference(model, x)
    assert torch.allclose(read.probs[0], ref, atol=TOL)
    uncapped = copy.deepcopy(model)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (eager_reference(uncapped, x) - ref).abs().max() > 1e-2

    # the trap, on a tiny Gemma-2 with its own scaling 1/16 (a valid dropout probability, so a
    # Llama-order positional call runs silently; queries sharpened through q_proj instead):
    # scaling lands in `dropout`, 0.0 in `scaling`
    plain = build_tiny("gemma2")
    for layer in plain.model.layers:
        layer.self_attn.q_proj.weight.mul_(SHARPEN)
    cache = kvcache.prefill(plain, x[:T])
    calls = {}

    def grab(base, module, query, key, value, attention_mask, **kwargs):
        calls.setdefault(module.layer_idx, (module, query, key, value, attention_mask, kwargs))
        return base(module, query, key, value, attention_mask, **kwargs)

    with attention_hook(plain, grab):
        kvcache.continuation_logprobs(plain, kvcache.view(cache, plain.config), x[T:], T)
    module, q, k, v, mask, kwargs = calls[1]                               # a full-attention layer
    eager = sys.modules[type(module).__module__].eager_attention_forward
    _, bad = eager(module, q, k, v, mask, kwargs["scaling"], 0.0)           # Llama order, positional
    bad = bad[0, :, -1].float()
    assert float((bad - 1 / (T + 1)).abs().max()) < 1e-6                   # uniform
    good = decision_forward(plain, cache, x[T:], capture=True).probs[0]
    ref_plain = eager_reference(plain, x)
    assert torch.allclose(good, ref_plain, atol=TOL)
    assert float(0.5 * (ref_plain[1] - 1 / (T + 1)).abs().sum()) > 0.15   # the true attention is not uniform


@pytest.fixture(scope="module", params=ARCHS)
def setup(request):
    model = sharpened(request.param, factor=MILD)
    x = ids(3)
    return model, x, kvcache.prefill(model, x[:T])


def test_knocking_out_nothing_changes_nothing(setup):
    model, x, cache = setup
    L = model.config.num_hidden_layers
    clean = decision_forward(model, cache, x[T:], capture=True)
    none = decision_forward(model, cache, x[T:], knock=torch.zeros(2, L, T, dtype=torch.bool), capture=True)
    assert torch.allclose(none.logprobs, clean.logprobs.expand(2, -1, -1), atol=TOL)
    assert torch.allclose(none.probs, clean.probs.expand(2, -1, -1), atol=TOL)
    assert kvcache.seq_length(cache) == T                                  # the prefix cache is untouched


def test_knockout_hides_exactly_the_chosen_keys(setup):
    """In the first knocked layer each head's decision-row distribution is the clean one with the
    knocked keys removed and renormalised (layers below are unchanged); knocked keys get zero mass in
    every knocked layer; the first knocked layer is a sliding one on Mistral/Gemma."""
    model, x, cache = setup
    L = model.config.num_hidden_layers
    groups = key_groups(FIELD, T, 1)
    variants = [(["field"], [0, L]), (["downstream"], [1, L]), (["sinks", "field"], [0, 1])]
    knock = knockout_masks(L, T, groups, variants)
    hooks = []
    for k in (None, knock):
        hook = DecisionRowHook(model, T, T, k, capture=True, keep_heads=True)
        with attention_hook(model, hook):
            lps = kvcache.continuation_logprobs(model, kvcache.expand_cache(cache, model.config, 1 if k is None else len(k)), x[T:], T)
        hooks.append(hook)
    clean, knocked = hooks
    had_mass = []
    for v, (names, (l0, l1)) in enumerate(variants):
        hidden = torch.zeros(T + 1, dtype=torch.bool)
        for g in names:
            hidden[slice(*groups[g])] = True
        for l in range(L):
            if l0 <= l < l1:
                assert float(knocked.probs[l][v, hidden].abs().max()) == 0.0
            elif l < l0:
                assert torch.allclose(knocked.head_probs[l][v], clean.head_probs[l][0], atol=TOL)
        expect = clean.head_probs[l0][0].masked_fill(hidden, 0.0)                 # [heads, T + 1]
        had_mass.append(float(expect.sum(-1).min()) < 1 - 1e-3)   # False when outside a sliding window
        assert torch.allclose(knocked.head_probs[l0][v], expect / expect.sum(-1, keepdim=True), atol=TOL)
    assert had_mass[1]                                                            # downstream is always visible
    assert (lps[:, 0] - lps[0:1, 0]).abs().max() > 1e-4                          # variants differ
    # decision_forward runs the variants cache-free on the one prefix (SharedDecisionRows): the
    # same log-probs and decision-row attention as the materialised batch view above
    shared = decision_forward(model, cache, x[T:], knock=knock, capture=True)
    assert torch.allclose(shared.logprobs, lps, atol=TOL)
    assert torch.allclose(shared.probs, torch.stack([knocked.probs[l] for l in range(L)], 1), atol=TOL)
    assert shared.recon_err < TOL


def test_batched_knockouts_equal_single_and_chunked(setup):
    model, x, cache = setup
    L = model.config.num_hidden_layers
    knock = knockout_masks(L, T, key_groups(FIELD, T, 2),
                           [([], [0, L]), (["field"], [0, L]), (["downstream"], [0, L]), (["sinks"], [1, L])])
    big = decision_forward(model, cache, x[T:], knock=knock)
    one = decision_forward(model, cache, x[T:], knock=knock, budget_bytes=1)
    assert torch.allclose(big.logprobs, one.logprobs, atol=TOL)
    for v in range(len(knock)):
        single = decision_forward(model, cache, x[T:], knock=knock[v:v + 1])
        assert torch.allclose(big.logprobs[v], single.logprobs[0], atol=TOL)


def test_two_prefixes_in_one_forward_equal_each_alone(setup):
    """A pair's two runs in the same forwards (``source``: one batch-2 attention call, each row over
    its own prefix's keys) give each run's knocked log-probs, decision-row attention and reconstruction check, on
    every tiny shape (sliding windows, soft-capping, one KV head), chunked or not."""
    model, x, cache = setup
    L = model.config.num_hidden_layers
    y = ids(5)
    other = kvcache.prefill(model, y[:T])
    knock = knockout_masks(L, T, key_groups(FIELD, T, 2),
                           [([], [0, L]), (["field"], [0, L]), (["downstream"], [1, L]), (["sinks"], [0, 1])])
    alone = [decision_forward(model, c, x[T:], knock=knock, capture=True) for c in (cache, other)]
    both = decision_forward(model, cache, x[T:], knock=knock, capture=True, source=other)
    V = knock.shape[0]
    assert both.logprobs.shape[0] == 2 * V
    assert (alone[0].logprobs - alone[1].logprobs).abs().max() > 1e-3            # the two prefixes differ
    for half, ref in enumerate(alone):
        rows = slice(half * V, (half + 1) * V)
        assert torch.allclose(both.logprobs[rows], ref.logprobs, atol=TOL)
        assert torch.allclose(both.probs[rows], ref.probs, atol=TOL)
    assert both.recon_err < TOL and both.recon_err_source < TOL
    clean = decision_forward(model, cache, x[T:], capture=True, source=other)   # no knockout: 2 rows
    assert torch.allclose(clean.logprobs, torch.cat([a.logprobs[:1] for a in alone]), atol=TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_knockout_all_layers_equals_removing_the_keys(arch):
    """Independent reference on full-attention models: hiding the field from the decision row in
    every layer equals decoding on a cache whose field slots are deleted (positions kept)."""
    model = sharpened(arch)
    x = ids(4)
    cache = kvcache.prefill(model, x[:T])
    L = model.config.num_hidden_layers
    knock = knockout_masks(L, T, key_groups(FIELD, T, 1), [(["field"], [0, L])])
    got = decision_forward(model, cache, x[T:], knock=knock).logprobs[0, 0]
    keep = torch.cat([torch.arange(FIELD[0]), torch.arange(FIELD[1], T)])
    cut = kvcache.cache_from_tensors(model.config, [l.keys[:, :, keep] for l in cache.layers],
                                     [l.values[:, :, keep] for l in cache.layers], len(keep))
    with torch.no_grad():
        out = model(input_ids=x[None, T:], position_ids=torch.tensor([[T]]), past_key_values=cut,
                    attention_mask=torch.ones(1, len(keep) + 1, dtype=torch.long))
    ref = torch.log_softmax(out.logits[0, -1].float(), -1)
    assert torch.allclose(got, ref, atol=TOL)
    clean = decision_forward(model, cache, x[T:]).logprobs[0, 0]
    assert (clean - ref).abs().max() > 1e-4


def test_key_groups_bands_and_masks():
    g = key_groups((5, 8), 20, 2)
    assert g == {"sinks": (0, 2), "prefix": (2, 5), "field": (5, 8), "downstream": (8, 20), "decision": (20, 21)}
    assert key_groups((1, 3), 9, 4)["sinks"] == (0, 1)                     # sinks clipped at the field
    assert sum(e - s for s, e in g.values()) == 21 and list(g) == list(GROUPS)
    assert [b["layers"] for b in layer_bands(30, [[0, 0.25], [0.25, 0.5], [0.75, 1.0], [0, 1]], "fraction")] == \
        [[0, 8], [8, 15], [23, 30], [0, 30]]
    assert layer_bands(30, [[2, 5]], "layer") == [{"name": "L2-4", "layers": [2, 5]}]
    with pytest.raises(ValueError):
        layer_bands(4, [[0.5, 0.5]], "fraction")
    with pytest.raises(ValueError):
        key_groups((5, 8), 20, -1)
    m = knockout_masks(3, 20, g, [(["field", "sinks"], [1, 3]), ([], [0, 3])]).dense()
    assert m.shape == (2, 3, 20) and int(m[0].sum()) == 2 * 5 and not m[0, 0].any() and not m[1].any()
    assert m[0, 1:, g["field"][0]: g["field"][1]].all() and m[0, 1:, g["sinks"][0]: g["sinks"][1]].all()
    with pytest.raises(ValueError):
        knockout_masks(3, 20, g, [(["decision"], [0, 3])])


def test_collapse_flags():
    lp = torch.log_softmax(torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0],      # clean: candidates 0 and 1 on top
                                         [0.0, 0.0, 5.0, 5.0, 5.0],      # both candidates collapse
                                         [4.0, 5.0, 0.0, 0.0, 0.0],      # decision changes, readout intact
                                         [2.5, 1.5, 3.0, 3.0, 3.0]]), -1)  # top-2 lost, drop < 3 nats
    f = collapse_flags(lp, (0, 1), drop_nats=3.0, top_k=2)
    assert f["drop"].tolist() == [False, True, False, False]
    assert f["topk_lost"].tolist() == [False, True, False, True]
    assert f["collapsed"].tolist() == [False, True, False, True]


def test_probe_runs_on_embedded_model(smol, tmp_path):
    scen = OmegaConf.merge(OmegaConf.load("conf/scenario/default.yaml"),
                           {"ids": ["favourite_colour", "greeting"], "n_instances": 1})
    pairs = prepare_pairs(smol.tokenizer, scen)
    cfg = OmegaConf.merge(probe_yaml("read_location"),
                          {"bands": [[0.75, 1.0]], "knockout_groups": [["field"], ["sinks"]], "n_boot": 200,
                           "progress": False})
    res = run_read_location(ProbeContext(bundle=smol, pairs=pairs, cfg=cfg, scenario_cfg=scen))
    rows, ko = res["rows"], res["knockout_rows"]
    n_var = len(cfg.knockout_groups) * len(cfg.bands)
    assert len(rows) == len(pairs.pairs) >= 4 and len(ko) == 2 * n_var * len(rows)
    checks = res["aggregates"]["checks"]
    assert checks["max_mass_sum_err"] < 1e-5 and checks["max_recon_err"] < 1e-4
    assert checks["max_null_knockout_err"] < 1e-4 and checks["max_knocked_mass"] == 0.0
    for r in rows:
        for run in ("old", "new"):
            m = torch.tensor(r[f"mass_{run}"])
            assert m.shape == (30, len(GROUPS)) and bool((m >= 0).all())
    # exclusions: tokenisation + non-flipping pairs, each counted once
    assert sum(res["exclusions"].values()) == len(pairs.excluded) + sum(not r["flips"] for r in rows)
    assert res["exclusions"] == dict(Counter(e["reason"] for e in res["excluded"]))
    # collapse bookkeeping is consistent
    for r in ko:
        assert r["flip_intact"] == (r["decision_changed"] and not r["collapsed"])
        assert r["collapsed"] == (r["collapse_drop"] or r["collapse_topk"])
    agg = res["aggregates"]["knockout"]["flipping"]
    assert set(agg) == {"all"} | {r["family"] for r in rows if r["flips"]}
    # measured on SmolLM2-135M: the favourite-colour recall pairs flip, and hiding the field from the
    # decision row in the last quarter of layers moves the new run's score towards the old run's
    assert "recall" in agg
    cell = agg["recall"]["new"]["field@L23-29"]
    assert cell["n"] >= 2 and cell["delta_toward_other"]["mean"] > 0.5
    check_figures("read_location", res, tmp_path)
    from kvnotes.probes.read_location import PRESENTATION
    from kvnotes.records.store import to_jsonable
    from tests.helpers import record_of

    rec = json.loads(json.dumps(to_jsonable(record_of("read_location", res))))   # as read back from a record
    assert all(spec.data(rec) for spec in PRESENTATION.figures)           # every figure finds its values


# -------------------- the generated readout (scenario.variant=cot)
# read_location under chain of thought (issue #20): knockouts hold on every decode step of a
# generated chain (the knocked keys get zero attention from every generated token, and the chain and
# its decision equal an independent decode on a cache without those keys), zero new tokens is the
# direct decision-row readout (scores and masses), and on the embedded model chains that miss their
# marker exclude the pair by reason while ``run.py`` writes a generated-readout record.

COT_T = 20                    # prefix length [0, COT_T); the decision token is fed at COT_T
COT_FIELD = (5, 9)
NEW = 6                   # tokens generated per chain
NEVER = token_marker([VOCAB + 5])


def _setup(arch: str, seed: int = 3):
    model = build_tiny(arch)
    for layer in model.model.layers:                      # peaked attention: knockouts matter
        layer.self_attn.scaling *= 10.0
    x = torch.randint(0, VOCAB, (COT_T + 1,), generator=torch.Generator().manual_seed(seed))
    return model, x, kvcache.prefill(model, x[:COT_T])


def _knock(model, groups, names_bands):
    L = model.config.num_hidden_layers
    return knockout_masks(L, COT_T, groups, [([], [0, L])] + names_bands)


@pytest.mark.parametrize("arch", ARCHS)
def test_knocked_keys_get_no_attention_from_any_generated_token(arch):
    model, x, cache = _setup(arch)
    L = model.config.num_hidden_layers
    groups = key_groups(COT_FIELD, COT_T, 1)
    variants = [(["field"], [0, L]), (["downstream"], [1, L]), (["sinks", "field"], [0, 1])]
    knock = _knock(model, groups, variants)
    gen, hook = generate_knocked(model, cache, int(x[COT_T]), NEW, NEVER, knock=knock, spans=chain_spans(groups, COT_T))
    masses = hook.step_masses()                                            # [V, steps, L, G]
    assert masses.shape == (len(knock), NEW + 1, L, len(CHAIN_GROUPS))
    assert torch.allclose(masses.sum(-1), torch.ones(masses.shape[:-1]), atol=TOL)
    assert hook.max_recon_err < TOL                                        # eager probs reproduce the executed output
    assert float(masses[:, 0, :, CHAIN_GROUPS.index("chain")].abs().max()) == 0.0   # step 0: nothing generated yet
    for v, (names, (l0, l1)) in enumerate(variants, start=1):
        idx = [CHAIN_GROUPS.index(g) for g in names]
        assert float(masses[v][:, l0:l1][..., idx].abs().max()) == 0.0    # every decode step, every knocked layer
    # the clean chain does attend to those keys on its decode steps (the check is not vacuous)
    assert float(masses[0, 1:, :, CHAIN_GROUPS.index("downstream")].min()) > 1e-4
    assert kvcache.seq_length(cache) == COT_T and all(not c.reached for c in gen.chains)
    # the clean row of the batch is the chain an unhooked decode produces
    plain, _ = generate_knocked(model, cache, int(x[COT_T]), NEW, NEVER)
    assert gen.chains[0].ids == plain.chains[0].ids


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_knocked_chain_equals_a_decode_without_the_keys(arch):
    """Independent reference on full-attention models: hiding the field from the decision query and
    every generated token in every layer equals greedy decoding on a cache whose field slots are
    deleted (positions kept), chain and the decision read after the marker."""
    model, x, cache = _setup(arch, seed=4)
    L = model.config.num_hidden_layers
    keep = torch.cat([torch.arange(COT_FIELD[0]), torch.arange(COT_FIELD[1], COT_T)])
    cut = kvcache.cache_from_tensors(model.config, [l.keys[:, :, keep] for l in cache.layers],
                                     [l.values[:, :, keep] for l in cache.layers], len(keep))
    ref_ids, tok, lps = [], int(x[COT_T]), []
    with torch.no_grad():
        for step in range(NEW + 1):
            out = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[COT_T + step]]), past_key_values=cut,
                        attention_mask=torch.ones(1, len(keep) + step + 1, dtype=torch.long))
            lps.append(torch.log_softmax(out.logits[0, -1].float(), -1))
            tok = int(lps[-1].argmax())
            ref_ids.append(tok)
    marker = token_marker(ref_ids[NEW - 1: NEW])                         # reached at the NEW-th token (or earlier)
    knock = _knock(model, key_groups(COT_FIELD, COT_T, 1), [(["field"], [0, L])])
    gen, _ = generate_knocked(model, cache, int(x[COT_T]), NEW, marker, knock=knock)
    chain = gen.chains[1]
    n = chain.length
    assert chain.reached and chain.ids == ref_ids[:n] and chain.marker_at == n - 1
    assert torch.allclose(gen.logprobs[1], lps[n], atol=TOL)
    assert chain.record() == {"ids": ref_ids[:n], "length": n, "marker_at": n - 1, "reached": True, "stopped": "marker"}
    clean = gen.chains[0]
    assert not clean.reached or (gen.logprobs[0] - gen.logprobs[1]).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_new_tokens_is_the_direct_knockout_readout(arch):
    model, x, cache = _setup(arch)
    L = model.config.num_hidden_layers
    groups = key_groups(COT_FIELD, COT_T, 1)
    knock = _knock(model, groups, [(["field"], [0, L]), (["downstream", "sinks"], [1, L])])
    gen, hook = generate_knocked(model, cache, int(x[COT_T]), 0, None, knock=knock, spans=chain_spans(groups, COT_T))
    direct = decision_forward(model, cache, x[COT_T:], knock=knock, capture=True)
    assert all(c.reached and c.ids == [] and c.marker_at is None for c in gen.chains)
    assert torch.allclose(gen.logprobs, direct.logprobs[:, 0], atol=TOL)
    masses = hook.step_masses()[:, 0]                                       # [V, L, G]: the decision query
    assert torch.allclose(masses[..., : len(GROUPS)], group_masses(direct.probs, groups), atol=TOL)
    assert float(masses[..., -1].abs().max()) == 0.0


@pytest.fixture(scope="module")
def recall_pairs(smol):
    scen = OmegaConf.merge(OmegaConf.load("conf/scenario/default.yaml"),
                           {"ids": ["favourite_colour"], "n_instances": 1, "variant": "cot"})
    return scen, prepare_pairs(smol.tokenizer, scen)


def test_chains_without_their_marker_exclude_the_pair(smol, recall_pairs):
    """Three new tokens never reach the marker: every screened pair is excluded by reason
    (``old_no_marker``), counted, with its chains; the rest are counted ``beyond_max_pairs``."""
    scen, pairs = recall_pairs
    cfg = OmegaConf.merge(probe_yaml("read_location"),
                          {"bands": [[0.75, 1.0]], "knockout_groups": [["field"]], "n_boot": 50, "progress": False,
                           "cot_max_new_tokens": 3, "cot_max_pairs": 2})
    res = run_read_location(ProbeContext(bundle=smol, pairs=pairs, cfg=cfg, scenario_cfg=scen))
    assert res["rows"] == [] and res["knockout_rows"] == [] and res["aggregates"]["readout"] == "generated"
    assert res["exclusions"] == dict(Counter(e["reason"] for e in res["excluded"])) | \
        {"beyond_max_pairs": len(pairs.pairs) - 2}
    screened = [e for e in res["excluded"] if e["reason"] == "old_no_marker"]
    assert len(screened) == 2
    for e in screened:
        assert e["chain_old"]["length"] == 3 and e["chain_old"]["marker_at"] is None
        assert len(e["chain_old"]["ids"]) == 3 and not e["chain_old"]["reached"]


@pytest.mark.embedded
def test_run_py_writes_a_generated_readout_record(smol, tmp_path):
    """End to end through ``run.py``'s job path on the embedded model: the record says the decisions were read
    after generated chains and keeps the chains and the exclusions."""
    rec = job_record(smol, tmp_path, "probe=read_location", "scenario=small", "scenario.variant=cot", "scenario.n_instances=1",
        "scenario.ids=[favourite_colour]", "probe.cot_max_pairs=1", "probe.cot_max_new_tokens=40",
        "probe.bands=[[0.5,1.0]]", "probe.knockout_groups=[[field]]", "probe.n_boot=50", "plot=false")
    res = rec["result"]
    agg = res["aggregates"]
    assert agg["readout"] == "generated" and agg["n_screened"] == 1 and res["groups"] == list(CHAIN_GROUPS)
    assert agg["n_reached"] + sum(v for k, v in res["exclusions"].items() if k.endswith("_no_marker")) == 1
    assert res["exclusions"]["beyond_max_pairs"] == rec["scenario"]["n_pairs_aligned"] - 1
    for r in res["rows"]:
        for run_name in ("old", "new"):
            chain = r[f"chain_{run_name}"]
            assert chain["reached"] and chain["marker_at"] == chain["length"] - 1 == len(chain["ids"]) - 1
            assert len(r[f"mass_{run_name}"]) == 30 and len(r[f"mass_{run_name}"][0]) == len(CHAIN_GROUPS)
    for k in res["knockout_rows"] + res["knockout_unreached"]:
        assert "ids" in k["chain"] and k["variant"] == "field@L15-29"
    if res["rows"]:
        assert agg["checks"]["max_knocked_mass"] == 0.0 and agg["checks"]["max_mass_sum_err"] < 1e-4


@pytest.mark.planted("read_location")
@pytest.mark.parametrize("family,alpha", [("notes", 0.0), ("mixed", 0.3), ("direct", 1.0)])
def test_read_location_knockouts_move_the_planted_shares(planted_arch, planted_cache, monkeypatch, family, alpha):
    """Hiding a key group from the decision query in every layer removes exactly what the model reads
    there: the downstream notes carry ``(1 - alpha) * beta`` nats of each clean score, the field
    ``alpha * beta`` (the score moves that far towards the other run's), the sinks nothing."""
    ctx = planted_context(planted_cache, monkeypatch, family, "read_location", {"planted": {"alpha": alpha}},
                          n_instances=1, scenario_ids=["adjacent"], arch=planted_arch)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    beta = planted_truth(ctx)["beta"]
    every = next(b["name"] for b in res["bands"] if b["layers"] == [0, planted.N_LAYERS])
    share = {"downstream": 1 - alpha, "field": alpha, "sinks": 0.0}
    for run, cells in res["aggregates"]["knockout"]["flipping"]["all"].items():
        for group, part in share.items():
            moved = cells[f"{group}@{every}"]["delta_toward_other"]["mean"]
            assert moved == pytest.approx(part * beta, abs=BAR * 2 * beta), (run, group)
