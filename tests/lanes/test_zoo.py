"""The zoo conformance lane (``pytest -m zoo``): every ``conf/model`` entry, on its shrunk random-weight
model (:func:`kvnotes.models.zoo.random_model`), through ``run.py``'s own job path (:func:`kvnotes.harness.jobs.run_job`).

Entries with the same structural signature (:func:`kvnotes.models.zoo.signature`) share one run, named for
each. Per run: the cache invariants (selective recompute over every downstream position equals the
full re-prefill; a re-positioned chunk equals the chunk prefilled at its target positions, through
``compose`` and ``compose_one_pass``), then every probe writes a record that validates against its
schema and holds its own invariants on that architecture. What the lane runs is what each probe
module declares (``CONFORMANCE``, :class:`kvnotes.harness.registry.Conformance`: work bounds, the
entries it runs on, multimodal settings, the TransformerLens backend, its record's invariants); the
lane names no probe. MLA entries (DeepSeek-V2) run the cache invariants; the probes' batched patched
readout does not reach MLA's latent cache yet and refuses it in one line (checked on every probe
that declares invariants).

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
from kvnotes.harness.registry import conformance
from kvnotes.models import zoo
from tests.helpers import default_probe

pytestmark = [pytest.mark.zoo, pytest.mark.embedded]

ROOT = Path(__file__).resolve().parents[2]
GROUPS = zoo.lane_groups()
#: fp32 K/V and log-probs of two computations of the same thing (different kernels / shapes).
KV_TOL = 1e-4
#: Random logits move by ~0.01 nats when the field changes; the synthetic rule's margin.
SYNTHETIC_MIN_EFFECT = 0.005

COMMON = ["model.random_init.enabled=true", "flip_rule=synthetic", f"min_effect={SYNTHETIC_MIN_EFFECT}",
          "plot=false", "device=cpu", "scenario=small", "scenario.families=null",
          "scenario.ids=[favourite_colour]", "scenario.n_instances=2",
          "probe.progress=false", "probe.n_boot=50"]
#: The two cache shapes where probes declared ``shapes="two"`` (and TransformerLens runs declared
#: ``"two"``) run: the Llama shape and Gemma's one KV head with sliding windows. The memory probes'
#: cache paths are the editable context's and compose's, which tests/context/test_context.py and
#: tests/ops/test_compose.py check on all five tiny architectures; on every entry they doubled the lane.
TWO_SHAPES = {"smollm2-135m", "gemma-3-1b"}


def lane_probes(model: str, bundle) -> list[str]:
    """The probes the lane runs on one entry, from what each declares
    (:class:`kvnotes.harness.registry.Conformance`): on an M-RoPE entry those with ``mrope`` settings."""
    from kvnotes.harness.registry import names

    mrope = bool(bundle.adapter.paths.get("rope_index"))
    return [n for n in names() if (c := conformance(n)).shapes != "none"
            and (c.shapes == "every" or model in TWO_SHAPES) and (not mrope or c.mrope is not None)]


def lens_probes(model: str, bundle) -> list[str]:
    """The probes the lane also runs on the TransformerLens backend on one entry (none on M-RoPE entries)."""
    from kvnotes.harness.registry import names

    if bundle.adapter.paths.get("rope_index"):
        return []
    return [n for n in names() if (t := conformance(n).transformer_lens) == "every" or (t == "two" and model in TWO_SHAPES)]


#: One line per zoo entry, printed at the end of the session (conftest's terminal summary).
LANE_LINES: list[str] = []


def compose_cfg(model: str, probe: str, extra: list[str] = ()):
    """The run config of ``probe`` on ``model`` in the lane: :data:`COMMON`, the probe's declared
    bounds, then ``extra``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"model={model}", f"probe={probe}", *COMMON,
                                            *conformance(probe).bounds, *extra])


def run_probe(model, probe, bundle, out: Path, extra=(), clean_runs=None) -> dict:
    from kvnotes.harness.jobs import run_job

    cfg = compose_cfg(model, probe, list(extra))
    path = run_job(cfg, out / probe / "-".join(extra).replace("=", "_"), {"launcher": "zoo lane"},
                   log=lambda _: None, bundle=bundle, clean_runs=clean_runs)
    rec = json.loads(path.read_text())
    assert rec["status"] == "complete" and rec["probe"] == probe
    assert rec["model"]["source"] == "random" and rec["config"]["flip_rule"] == "synthetic"
    return rec


def check_invariants(recs: dict, require: bool = True) -> list[str]:
    """Each record's own invariants (:attr:`kvnotes.harness.registry.Conformance.invariants`); returns
    what was checked over how many rows. Fails on any violation, and (``require``) when no probe had a
    flipping row to check (the lane would check nothing)."""
    done = []
    for name, rec in recs.items():
        check = conformance(name).invariants
        if check is None:
            continue
        held = check(rec)
        assert not held.violations, f"{name}: {held.what}: {held.violations}"
        done.append(f"{held.what} ({held.n})")
    assert not require or any(not c.endswith("(0)") for c in done), \
        "no pair flips under the synthetic rule: the lane would check nothing"
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

    bundle = load_bundle(compose_cfg(model, default_probe()))           # any probe's config: the model is the entry's
    assert bundle.adapter.n_kv_heads == zoo.architecture_config(zoo.zoo_config(model)).get_text_config(
        decoder=True).num_key_value_heads
    check_selective_equals_full(bundle)
    reposition = check_reposition(bundle)
    if bundle.adapter.rope_slot == "values":
        # MLA: the cache invariants above hold; the probes' batched patched readout substitutes cached
        # K/V inside attention, where MLA sees keys expanded from its latent, not the cache: refused in
        # one line (kvnotes.kv.patch.check_per_head, #24)
        from kvnotes.errors import KvnotesError

        patching = [n for n in lane_probes(model, bundle) if conformance(n).invariants]
        for probe in patching:              # the probes whose invariants are read through patched runs
            with pytest.raises(KvnotesError, match="latent") as err:
                run_probe(model, probe, bundle, tmp_path)
            assert "\n" not in str(err.value)
        for name in GROUPS[model]:
            LANE_LINES.append(f"zoo {name:30s} run as {model:28s} selective=full, reposition ok ({reposition}); "
                              f"probes: {len(patching)} refused (patched readout on the MLA latent)")
        return
    mrope = bool(bundle.adapter.paths.get("rope_index"))
    store = CleanRuns()                 # one entry's probes prefill each prompt once (same numbers: tests/harness/test_kit.py)
    recs = {name: run_probe(model, name, bundle, tmp_path, list(conformance(name).mrope or ()) if mrope else [], store)
            for name in lane_probes(model, bundle)}
    checks = check_invariants(recs)
    tl = []
    for name in lens_probes(model, bundle):       # last: the TransformerLens bridge switches the model to eager
        try:
            rec = run_probe(model, name, bundle, tmp_path, ["probe.backend=transformer_lens"])
            check_invariants({name: rec}, require=False)
            tl.append(name)
        except ValueError as exc:              # no TransformerLens adapter for this architecture
            assert "architecture" in str(exc).lower() or "not supported" in str(exc).lower(), exc
        except ImportError as exc:             # its adapter needs an optional package (Qwen3-VL: torchvision)
            assert "optional" in str(exc).lower(), exc
            tl.append(f"{name} unavailable (optional dependency missing)")
    for name in GROUPS[model]:
        LANE_LINES.append(f"zoo {name:30s} run as {model:28s} {len(recs)} probes ok, "
                          f"{', '.join(checks)}, selective=full, reposition ok ({reposition}); TransformerLens: "
                          f"{', '.join(tl) or 'no adapter'}")
