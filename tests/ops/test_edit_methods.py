"""The edit-method registry (kvnotes.ops.methods) holds to its declarations: each method's steps make
the edit its operation makes, its cost model is what the operation reports, the runner's one forward
is the eager edit, and the context's modes are the registry's. One Decision type and one erratum
template serve the harness and the context."""

from __future__ import annotations

import pytest
import torch

from kvnotes.errors import KvnotesError
from kvnotes.kv.cache import AllSlotCache
from kvnotes.ops import edit, methods
from kvnotes.ops.edit_runner import EditRunner
from kvnotes.ops.methods import METHODS, EditSource, Geometry, Prompted
from tests.helpers import build_tiny
from tests.ops.test_edit import FIELD, TOL, kv_diff, tiny_pair

D = 20
K = 4


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return build_tiny(request.param)


def source(model) -> EditSource:
    """A tiny pair with an erratum (12 tokens inserted at 14) and a hoisted layout (the field moved to
    just before the last 3 positions)."""
    old, new = tiny_pair()
    stale = AllSlotCache.prefill(model, old[:D])
    notice = torch.arange(10, 22)
    erratum = torch.cat([old[:14], notice, old[14:]])
    a, b = FIELD
    hoist_old = torch.cat([old[:a], old[b:D - 2], old[a:b], old[D - 2:]])
    hoist_new = torch.cat([old[:a], old[b:D - 2], new[a:b], old[D - 2:]])
    reuse = D - 2 - (b - a)
    hoisted = AllSlotCache.prefill(model, hoist_old[:D])
    return EditSource(model, stale, new, FIELD, D, int(old[D]),
                      {"erratum": Prompted(stale, erratum, 14, len(erratum) - 1),
                       "hoist": Prompted(hoisted, hoist_new, reuse, D)})


def direct(model, name: str, src: EditSource, picks: list[int]) -> edit.Edited:
    """The method's edit written out with its operation, as the readers did before the registry."""
    op = METHODS[name].operation
    refreshed = edit.refresh_field(model, src.stale, src.new_ids, src.field)
    if name == "stale":
        return edit.Edited(src.stale, D, 0, 0.0, 0.0)
    if name == "refresh_field":
        return op(model, src.stale, src.new_ids, src.field)
    if name == "full":
        return op(model, src.new_ids, D)
    if name == "selective":
        return op(model, refreshed, src.new_ids, picks)
    if name == "oracle_copy":
        return op(refreshed, edit.full(model, src.new_ids, D).cache, picks)
    p = src.prompt(METHODS[name].prompt)
    return op(model, refreshed.cache if METHODS[name].refresh else p.cache, p.ids, p.reuse, p.end)


@torch.no_grad()
@pytest.mark.parametrize("name", [n for n, m in METHODS.items() if m.prompt not in ("wrong_erratum", "irrelevant_notice")])
def test_apply_makes_the_operations_edit_and_the_cost_model_counts_it(model, name):
    src, m = source(model), METHODS[name]
    order = methods.RANKINGS["last"].rank(src)
    e, tok = methods.apply(m, src, K, order)
    ref = direct(model, name, src, order[0][:K])
    assert e.pos == ref.pos and kv_diff(e.cache, ref.cache, e.pos) < TOL
    cost = m.cost(src.geometry(m), K)
    if m.upper_bound:                                   # copies: only the field is recomputed
        assert cost.tokens == FIELD[1] - FIELD[0] and e.tokens == cost.tokens + K
        return
    assert e.tokens == cost.tokens
    if not m.ranked:                                    # ranked positions are costed at their earliest
        assert e.flops == pytest.approx(cost.flops(model.config), rel=1e-12)
    assert tok == (int(src.prompt(m.prompt).ids[e.pos]) if m.prompt else src.token)


def test_cost_model_spans():
    g = Geometry((4, 7), 20, reuse=14, end=31)
    spans = {n: (m.cost(g, 5).spans, m.cost(g, 5).cached) for n, m in METHODS.items()}
    assert spans["full"] == (((0, 20),), 0)
    assert spans["refresh_field"] == (((4, 7),), 4)
    assert spans["erratum"] == (((14, 31),), 14)
    assert spans["field_plus_erratum"] == (((4, 7), (14, 31)), 14)
    assert spans["selective"] == (((4, 7), (7, 12)), 20)
    assert spans["oracle_copy"] == (((4, 7),), 4) and spans["stale"] == ((), 20)
    with pytest.raises(ValueError):
        METHODS["erratum"].cost(Geometry((4, 7), 20))


@torch.no_grad()
def test_the_runner_makes_each_methods_edit_in_one_forward(model):
    src = source(model)
    runner = EditRunner(model, 48)
    picks = methods.RANKINGS["last"].rank(src)[0][:K]
    for m in METHODS.values():
        if not src.supports(m):                          # the controls' prompts: not offered here
            continue
        if m.reprefill or not m.recomputes:
            with pytest.raises(ValueError):
                m.positions(src.geometry(m), picks)
            continue
        e, tok = methods.apply(m, src.fresh(), K, (picks, dict(methods.FREE)))
        pool, _ = runner.apply(m, src, picks)
        got = pool.all_slot_view(e.pos)
        assert kv_diff(got, e.cache, e.pos) < TOL, m.name
        assert float((edit.decision_logprobs(model, got, tok, e.pos)
                      - edit.decision_logprobs(model, e.cache, tok, e.pos)).abs().max()) < TOL, m.name


def test_the_registry_declares_each_method_once():
    assert list(METHODS)[:6] == ["stale", "refresh_field", "erratum", "field_plus_erratum", "hoist", "selective"]
    assert methods.controls() == ("wrong_erratum", "irrelevant_notice")
    assert METHODS[methods.REFERENCE].reprefill
    assert [n for n, m in METHODS.items() if m.upper_bound] == ["oracle_copy"]
    assert METHODS["selective"].variant("attention", 8) == "selective_attention@8"
    with pytest.raises(ValueError):
        methods.register(METHODS["erratum"])
    with pytest.raises(KvnotesError):
        EditSource(None, None, torch.zeros(3), (0, 1), 2, 0).prompt("erratum")
    with pytest.raises(KvnotesError):
        EditSource(None, None, torch.zeros(3), (0, 1), 2, 0).rng()


def test_context_modes_and_the_probe_read_the_registry():
    import kvnotes.probes.edit as probe
    from kvnotes import context
    from kvnotes.bench import edit as bench_edit

    assert context.MODES == ("stale", "in_place", "erratum", "field_plus_erratum", "selective", "full", "auto")
    assert context.CHECKS == ("field_plus_erratum", "selective@K", "selective@P%")
    assert methods.for_mode("in_place") is METHODS["refresh_field"]
    assert probe.EDIT_METHODS == ("stale", "refresh_field", "erratum", "field_plus_erratum", "hoist", "full",
                                  "wrong_erratum", "irrelevant_notice")
    assert probe.CONTROLS == ["wrong_erratum", "irrelevant_notice"]
    assert set(probe.PROMPTS) >= {m.prompt for m in METHODS.values() if m.prompt}
    assert bench_edit.RANKINGS == ("last", "attention", "kv_deviation")
    with pytest.raises(KvnotesError, match="selective@K / selective@P%"):
        context.parse_mode("selective")


def test_one_decision_type_and_one_erratum_template():
    from kvnotes import context
    from kvnotes.harness import edit_prompts, readout
    from kvnotes.kv.decision import Decision, verdict

    assert context.Decision is readout.Decision is Decision
    assert edit_prompts.ERRATUM_TEMPLATE is context.ERRATUM_TEMPLATE
    clean = Decision(top1=7, p_top1=0.4, expected=7, cand_mass=0.5)
    assert clean.owns and clean.owned
    assert not Decision(top1=3, p_top1=0.4, expected=7, cand_mass=0.5).owns
    read = Decision(("yes", "no"), torch.tensor([-0.1, -2.1]), "yes", False, torch.zeros(0))
    assert read.owns is False and read.owned is False
    with pytest.raises(ValueError):
        Decision(top1=3)
    with pytest.raises(KvnotesError):
        verdict(clean, clean)
