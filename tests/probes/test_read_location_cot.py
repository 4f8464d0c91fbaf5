"""read_location under chain of thought (issue #20): knockouts hold on every decode step of a
generated chain (the knocked keys get zero attention from every generated token, and the chain and
its decision equal an independent decode on a cache without those keys), zero new tokens is the
direct decision-row readout (scores and masses), and on the embedded model chains that miss their
marker exclude the pair by reason while ``run.py`` writes a generated-readout record."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from omegaconf import OmegaConf

from kvnotes.harness.pairs import prepare_pairs
from kvnotes.kv import cache as kvcache
from kvnotes.kv.generate import token_marker
from kvnotes.kv.knockout import decision_forward, generate_knocked, knockout_masks
from kvnotes.probes import ProbeContext
from kvnotes.probes.read_location import CHAIN_GROUPS, GROUPS, chain_spans, group_masses, key_groups
from kvnotes.probes.read_location import run as run_read_location
from tests.helpers import job_record, ARCHS, VOCAB, build_tiny

T = 20                    # prefix length [0, T); the decision token is fed at T
FIELD = (5, 9)
NEW = 6                   # tokens generated per chain
NEVER = token_marker([VOCAB + 5])
TOL = 1e-5


def _setup(arch: str, seed: int = 3):
    model = build_tiny(arch)
    for layer in model.model.layers:                      # peaked attention: knockouts matter
        layer.self_attn.scaling *= 10.0
    x = torch.randint(0, VOCAB, (T + 1,), generator=torch.Generator().manual_seed(seed))
    return model, x, kvcache.prefill(model, x[:T])


def _knock(model, groups, names_bands):
    L = model.config.num_hidden_layers
    return torch.cat([torch.zeros(1, L, T, dtype=torch.bool), knockout_masks(L, T, groups, names_bands)])


@pytest.mark.parametrize("arch", ARCHS)
def test_knocked_keys_get_no_attention_from_any_generated_token(arch):
    model, x, cache = _setup(arch)
    L = model.config.num_hidden_layers
    groups = key_groups(FIELD, T, 1)
    variants = [(["field"], [0, L]), (["downstream"], [1, L]), (["sinks", "field"], [0, 1])]
    knock = _knock(model, groups, variants)
    gen, hook = generate_knocked(model, cache, int(x[T]), NEW, NEVER, knock=knock, spans=chain_spans(groups, T))
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
    assert kvcache.seq_length(cache) == T and all(not c.reached for c in gen.chains)
    # the clean row of the batch is the chain an unhooked decode produces
    plain, _ = generate_knocked(model, cache, int(x[T]), NEW, NEVER)
    assert gen.chains[0].ids == plain.chains[0].ids


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_knocked_chain_equals_a_decode_without_the_keys(arch):
    """Independent reference on full-attention models: hiding the field from the decision query and
    every generated token in every layer equals greedy decoding on a cache whose field slots are
    deleted (positions kept), chain and the decision read after the marker."""
    model, x, cache = _setup(arch, seed=4)
    L = model.config.num_hidden_layers
    keep = torch.cat([torch.arange(FIELD[0]), torch.arange(FIELD[1], T)])
    cut = kvcache.cache_from_tensors(model.config, [l.keys[:, :, keep] for l in cache.layers],
                                     [l.values[:, :, keep] for l in cache.layers], len(keep))
    ref_ids, tok, lps = [], int(x[T]), []
    with torch.no_grad():
        for step in range(NEW + 1):
            out = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[T + step]]), past_key_values=cut,
                        attention_mask=torch.ones(1, len(keep) + step + 1, dtype=torch.long))
            lps.append(torch.log_softmax(out.logits[0, -1].float(), -1))
            tok = int(lps[-1].argmax())
            ref_ids.append(tok)
    marker = token_marker(ref_ids[NEW - 1: NEW])                         # reached at the NEW-th token (or earlier)
    knock = _knock(model, key_groups(FIELD, T, 1), [(["field"], [0, L])])
    gen, _ = generate_knocked(model, cache, int(x[T]), NEW, marker, knock=knock)
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
    groups = key_groups(FIELD, T, 1)
    knock = _knock(model, groups, [(["field"], [0, L]), (["downstream", "sinks"], [1, L])])
    gen, hook = generate_knocked(model, cache, int(x[T]), 0, None, knock=knock, spans=chain_spans(groups, T))
    direct = decision_forward(model, cache, x[T:], knock=knock, capture=True)
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
    cfg = OmegaConf.merge(OmegaConf.load("conf/probe/read_location.yaml"),
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
