"""The zoo conformance lane (``pytest -m zoo``): every ``conf/model`` entry, on its shrunk random-weight
model (:func:`kvnotes.models.zoo.random_model`), through ``run.py``'s own job path (:func:`kvnotes.harness.jobs.run_job`).

Entries with the same structural signature (:func:`kvnotes.models.zoo.signature`) share one run, named for
each. Per run: every probe and circuit writes a record that validates against its schema (the circuits
also on TransformerLens where it has an adapter for the architecture: ``components`` on every entry,
all three on two shapes, :data:`TL_EVERY`; the memory
probes on two shapes and a core set on multimodal entries, :func:`lane_probes`), and the
invariants hold on that architecture: field + downstream recovery = 1 and everything-patched = 1,
the exact field refresh equals the copied field K/V, the DLA parts add up to the logit difference,
trigger + notes = 1 in the polarity 2x2, selective recompute over every downstream position equals
the full re-prefill, and a re-positioned chunk equals the chunk prefilled at its target positions
(``compose`` and ``compose_one_pass``). MLA entries (DeepSeek-V2) run the cache invariants; the probes'
batched patched readout does not reach MLA's latent cache yet and refuses it in one line (checked).

Random weights decide nothing, so flips are counted with ``flip_rule=synthetic`` (the margin
alone; refused for checkpoints) at a margin fitted to random logits; records say so. The lane's
prompts are rendered with the embedded SmolLM2 tokenizer (the vocabulary shrinks to it), which is
why it is also marked ``embedded``. The probes' work is bounded per probe (fewer random draws,
sweep points and seams) to keep the lane within a few minutes on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvnotes.harness.kit import CleanRuns
from kvnotes.models import zoo

pytestmark = [pytest.mark.zoo, pytest.mark.embedded]

ROOT = Path(__file__).resolve().parents[2]
GROUPS = zoo.lane_groups()
#: Recovery ratios are quotients of fp32 score differences of ~0.01 nats on random weights.
RECOVERY_TOL = 2e-3
#: fp32 K/V and log-probs of two computations of the same thing (different kernels / shapes).
KV_TOL = 1e-4
#: DLA parts vs the model's own logit difference (nats).
DLA_TOL = 1e-3
#: Random logits move by ~0.01 nats when the field changes; the synthetic rule's margin.
SYNTHETIC_MIN_EFFECT = 0.005

COMMON = ["model.random_init.enabled=true", "flip_rule=synthetic", f"min_effect={SYNTHETIC_MIN_EFFECT}",
          "plot=false", "device=cpu", "scenario=small", "scenario.families=null",
          "scenario.ids=[favourite_colour]", "scenario.n_instances=2",
          "probe.progress=false", "probe.n_boot=50"]
#: Work bounds per probe (every method and arm still runs).
BOUNDS = {
    "heads": ["probe.random.n_draws=1", "probe.max_map_pairs_per_family=1", "probe.ks=[1,4]"],
    "dissociation": ["scenario.ids=[account_role]"],
    "suffix_recovery": ["probe.random.n_draws=1", "probe.grid.fractions=[0.5,1.0]", "probe.grid.counts=[1,4]",
                        "probe.layer_bands=2"],
    "compose": ["probe.seams=[0,2]", "probe.sinks=[bos]", "probe.edit_arm_seams=[0]"],
    "edit": ["probe.ks=[0,4]", "probe.max_pairs=4", "probe.sweep_max_pairs=1", "probe.max_control_pairs=2"],
    "direction": ["probe.n_layers_scan=2", "probe.random.n_draws=1", "probe.max_pairs_per_family=1",
                  "probe.fit_scope=scenario"],
    "read_location": ["probe.bands=[[0.0,0.5],[0.0,1.0]]", "probe.knockout_groups=[[field],[downstream]]"],
    "agent": ["probe.turns=2"],
    "scrubbing": ["probe.random.n_draws=1"],
    "sae_features": ["probe.n_layers_scan=2", "probe.expansion=1", "probe.k=4", "probe.steps=10", "probe.batch=64", "probe.ks=[1]",
                     "probe.random.n_draws=1"],
    "memory_transplant": ["probe.lengths=[96]", "probe.personas=[maria]", "probe.seams=[0,1]"],
    "memory_edits": ["probe.lengths=[96]", "probe.personas=[maria]", "probe.ks=[4]"],
    "memory_granularity": ["probe.lengths=[96]", "probe.personas=[maria]", "probe.blocks=[1,2]"],
    "memory_agent": ["probe.lengths=[96]", "probe.personas=[maria]", "probe.turns=2", "probe.long_turns=3",
                     "probe.long_length=96"],
    "memory_placement": ["probe.lengths=[96]", "probe.personas=[maria]"],
}
CIRCUITS = ("components", "heads", "direction")
#: On the TransformerLens backend every entry runs ``components`` (its record must hold the DLA sums
#: too: the bridge's hook names and head outputs of that architecture); ``heads`` and ``direction``
#: read the same hooks through the same engine calls, so they run on two shapes only (those of
#: :data:`MEMORY_LANE`): on every entry they cost ~2.5 s each and checked no other code.
TL_EVERY = ("components",)
#: The memory probes (pairs: none) run on two shapes only: the Llama shape and Gemma's one KV head
#: with sliding windows. Their cache paths are the editable context's and compose's, which
#: tests/context/test_context.py and tests/ops/test_compose.py check on all five tiny architectures; on every
#: entry they doubled the lane.
MEMORY_LANE = {"smollm2-135m", "gemma-3-1b"}
#: Probes built from machinery every other entry already exercises (K/V patches, RoPE repositioning,
#: engine additions, the single-position map) run on the same two shapes as the memory probes: there
#: what is theirs (a donor's K/V carried into a windowed cache; an SAE's training and clamps) meets
#: one KV head and sliding windows; on every entry they added about 20 s to the lane.
TWO_SHAPE_PROBES = ("scrubbing", "sae_features")
#: Probes whose data is a file the lane does not ship (LoCoMo; its splice is compose's, which runs on
#: every entry; tests/probes/test_locomo.py runs it on tiny Llama and Gemma-3 models and the embedded one).
DATA_PROBES = ("locomo",)
#: Multimodal (M-RoPE) entries run field refresh (the recovery invariants), edit and compose: their
#: text decoder is a Qwen decoder the other entries cover; what is theirs is the 3-D position
#: bookkeeping (compose and the re-positioning check). No TransformerLens circuits for them.
MROPE_PROBES = ("field_refresh", "edit", "compose")
#: Their compose runs one seam and no edit arms (Qwen2.5-VL keeps its 2048 width when shrunk).
MROPE_BOUNDS = {"compose": ["probe.seams=[0]", "probe.edit_arm_seams=[]"]}


def lane_probes(model: str, bundle) -> list[str]:
    """The probes the lane runs on one entry (:data:`MEMORY_LANE`, :data:`TWO_SHAPE_PROBES`, :data:`MROPE_PROBES`)."""
    import kvnotes.probes

    names = [n for n in kvnotes.probes.names()
             if (not (n.startswith("memory_") or n in TWO_SHAPE_PROBES) or model in MEMORY_LANE) and n not in DATA_PROBES]
    if bundle.adapter.paths.get("rope_index"):
        names = [n for n in names if n in MROPE_PROBES]
    return names
#: One line per zoo entry, printed at the end of the session (conftest's terminal summary).
LANE_LINES: list[str] = []


def compose_cfg(model: str, probe: str, extra: list[str] = ()):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"model={model}", f"probe={probe}", *COMMON, *BOUNDS.get(probe, ()),
                                            *extra])


def run_probe(model, probe, bundle, out: Path, extra=(), clean_runs=None) -> dict:
    from kvnotes.harness.jobs import run_job

    cfg = compose_cfg(model, probe, list(extra))
    path = run_job(cfg, out / probe / "-".join(extra).replace("=", "_"), {"launcher": "zoo lane"},
                   log=lambda _: None, bundle=bundle, clean_runs=clean_runs)
    rec = json.loads(path.read_text())
    assert rec["status"] == "complete" and rec["probe"] == probe
    assert rec["model"]["source"] == "random" and rec["config"]["flip_rule"] == "synthetic"
    return rec


def flipping(rec: dict) -> list[dict]:
    return [r for r in rec["result"]["rows"] if r.get("flips")]


def check_invariants(recs: dict) -> list[str]:
    """The record-level invariants; returns the checks that had pairs to check."""
    done = []
    rows = flipping(recs["field_refresh"])
    assert rows, "no pair flips under the synthetic rule: the lane would check nothing"
    for r in rows:
        assert r["r_field_downstream"] == pytest.approx(1.0, abs=RECOVERY_TOL), r["pair"]
        assert r["r_all"] == pytest.approx(1.0, abs=RECOVERY_TOL), r["pair"]
        assert r["r_field_exact"] == pytest.approx(r["r_field"], abs=RECOVERY_TOL), r["pair"]
        assert max(r["k_max_abs_diff"], r["v_max_abs_diff"]) < KV_TOL, r["pair"]
    done.append(f"field+downstream=1 ({len(rows)} pairs)")
    if "components" in recs:
        comp = flipping(recs["components"])
        for r in comp:
            assert abs(r["decomposition_error"]) < DLA_TOL and abs(r["logit_diff_error"]) < DLA_TOL, r["pair"]
        done.append(f"DLA sums ({len(comp)})")
    if "dissociation" in recs:
        pol = flipping(recs["dissociation"])
        for r in pol:
            assert r["r_both"] == pytest.approx(1.0, abs=RECOVERY_TOL), r["pair"]
        done.append(f"trigger+notes=1 ({len(pol)})")
    return done


def check_selective_equals_full(bundle) -> None:
    """Refreshing the field and recomputing every downstream position equals a full re-prefill."""
    from kvnotes.kv.cache import AllSlotCache
    from kvnotes.ops import edit

    model = bundle.model
    g = torch.Generator().manual_seed(1)
    old = torch.randint(10, 2000, (40,), generator=g)
    new = old.clone()
    new[12:14] = torch.randint(2000, 4000, (2,), generator=g)
    d = 39
    stale = AllSlotCache.prefill(model, old[:d])
    refreshed = edit.refresh_field(model, stale, new, (12, 14))
    sel = edit.selective(model, refreshed, new, range(14, d))
    full = edit.full(model, new, d)
    for a, b in zip(sel.cache.layers, full.cache.layers):
        assert (a.keys - b.keys).abs().max() < KV_TOL and (a.values - b.values).abs().max() < KV_TOL
    lp_sel = edit.decision_logprobs(model, sel.cache, int(new[d]), d)
    lp_full = edit.decision_logprobs(model, full.cache, int(new[d]), d)
    assert (lp_sel - lp_full).abs().max() < KV_TOL


def check_reposition(bundle) -> str:
    """A chunk prefilled at 0..n-1 and re-positioned to p..p+n-1 equals the chunk prefilled at
    p..p+n-1 (every layer's cached K/V: the rotary part turned, MLA's latent and every value
    untouched); ``compose_one_pass`` equals ``compose``; the no-rotate control differs."""
    from kvnotes.ops import compose as kvcompose

    model = bundle.model
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(10, 4000, (30,), generator=g)
    prefix, chunk_ids, tail = ids[:8], ids[8:24], ids[24:]
    chunk = kvcompose.precompile(model, chunk_ids)
    placed = kvcompose.precompile(model, chunk_ids, offset=8)
    keys, values = kvcompose.reposition(model, chunk.keys, chunk.values, 8)
    for got, want in zip(keys + values, placed.keys + placed.values, strict=True):
        assert (got - want).abs().max() < KV_TOL
    _, logits = kvcompose.compose(model, [prefix, chunk, tail], True, 0)
    _, no_rot = kvcompose.compose(model, [prefix, chunk, tail], False, 0)
    assert (torch.log_softmax(no_rot, -1) - torch.log_softmax(logits, -1)).abs().max() > KV_TOL
    if kvcompose.has_sliding_layers(model):     # compose_one_pass refuses sliding windows (one line)
        with pytest.raises(ValueError, match="sliding"):
            kvcompose.compose_one_pass(model, [prefix, chunk, tail], True, 0)
        return "compose (one-pass: refused, sliding layers)"
    _, one = kvcompose.compose_one_pass(model, [prefix, chunk, tail], True, 0)
    assert (torch.log_softmax(one, -1) - torch.log_softmax(logits, -1)).abs().max() < KV_TOL
    return "compose + one-pass"


@pytest.mark.parametrize("model", sorted(GROUPS), ids=[f"{m}[{'+'.join(GROUPS[m])}]" for m in sorted(GROUPS)])
def test_zoo_entry(model, tmp_path):
    from kvnotes.harness.jobs import load_bundle

    bundle = load_bundle(compose_cfg(model, "screen"))
    assert bundle.adapter.n_kv_heads == zoo.architecture_config(zoo.zoo_config(model)).get_text_config(
        decoder=True).num_key_value_heads
    check_selective_equals_full(bundle)
    reposition = check_reposition(bundle)
    if bundle.adapter.rope_slot == "values":
        # MLA: the cache invariants above hold; the probes' batched patched readout substitutes cached
        # K/V inside attention, where MLA sees keys expanded from its latent, not the cache: refused in
        # one line (kvnotes.kv.patch.check_per_head, #24)
        from kvnotes.errors import KvnotesError

        with pytest.raises(KvnotesError, match="latent") as err:
            run_probe(model, "field_refresh", bundle, tmp_path)
        assert "\n" not in str(err.value)
        for name in GROUPS[model]:
            LANE_LINES.append(f"zoo {name:30s} run as {model:28s} selective=full, reposition ok ({reposition}); "
                              f"probes: refused (patched readout on the MLA latent)")
        return
    mrope = bool(bundle.adapter.paths.get("rope_index"))
    store = CleanRuns()                 # one entry's probes prefill each prompt once (same numbers: tests/harness/test_kit.py)
    recs = {name: run_probe(model, name, bundle, tmp_path, MROPE_BOUNDS.get(name, []) if mrope else [], store)
            for name in lane_probes(model, bundle)}
    checks = check_invariants(recs)
    tl = []
    tl_circuits = () if mrope else CIRCUITS if model in MEMORY_LANE else TL_EVERY
    for name in tl_circuits:                      # last: the TransformerLens bridge switches the model to eager
        try:
            rec = run_probe(model, name, bundle, tmp_path, ["probe.backend=transformer_lens"])
            if name == "components":
                check_invariants({"field_refresh": recs["field_refresh"], "components": rec})
            tl.append(name)
        except ValueError as exc:              # no TransformerLens adapter for this architecture
            assert "architecture" in str(exc).lower() or "not supported" in str(exc).lower(), exc
        except ImportError as exc:             # its adapter needs an optional package (Qwen3-VL: torchvision)
            assert "optional" in str(exc).lower(), exc
            tl.append(f"{name} unavailable (optional dependency missing)")
    flips = len(flipping(recs["field_refresh"]))
    for name in GROUPS[model]:
        LANE_LINES.append(f"zoo {name:30s} run as {model:28s} {len(recs)} probes ok, {flips} synthetic flips, "
                          f"{', '.join(checks)}, selective=full, reposition ok ({reposition}); TransformerLens: "
                          f"{', '.join(tl) or 'no adapter'}")
