"""The editable-context API (kvnotes/context.py): every mode against an independent reference on each
tiny architecture (random weights, the embedded SmolLM2 tokenizer), bad input, and the docs example
on both embedded models."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as T

from kvnotes.context import EditableContext, parse_mode
from kvnotes.errors import KvnotesError
from tests.helpers import ROOT, ARCHS, LOGPROB_TOL, tiny_config

#: K/V of a recomputed span vs a full prefill (different forward shapes: BLAS blocking differs).
KV_TOL = 1e-5
#: decision log-probs of a spliced/composed cache vs a full prefill (a longer chain of kernels).
COMPOSE_TOL = 1e-4
CANDS = [" yes", " no"]


@pytest.fixture(scope="module")
def tok():
    from kvnotes.models.loading import load_tokenizer
    from kvnotes.models.zoo import zoo_config

    return load_tokenizer(zoo_config("smollm2-135m"))


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tok):
    torch.manual_seed(0)
    cfg = tiny_config(request.param)
    cfg.vocab_size = len(tok)
    return T.AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


def order_context(model, tok, status="shipped", **kw) -> EditableContext:
    ctx = EditableContext(model, tok, "Answer:", **kw)
    ctx.add_text("Order 1042 was placed on 3 May. Order status: ")
    ctx.add_field("status", status, label="the order status")
    ctx.add_text(".\nPolicy: an order can be cancelled only while its status is pending.")
    ctx.add_request("\nCan the customer still cancel order 1042? Answer yes or no.")
    return ctx


def all_sliding(model) -> bool:
    """Every layer is a sliding-window layer (the tiny Mistral: window 8, shorter than the prompt)."""
    return bool(getattr(model.config, "sliding_window", None) and not getattr(model.config, "layer_types", None))


def reference_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 next-token log-probs ``[vocab]`` after a plain forward of the whole prompt."""
    with torch.no_grad():
        return model(input_ids=ids.view(1, -1)).logits[0, -1].float().log_softmax(-1)


def test_prefill_and_decide_equal_a_plain_forward(model, tok):
    ctx = order_context(model, tok)
    cost = ctx.prefill()
    assert cost.tokens == ctx.layout.length - 1
    d = ctx.decide(CANDS)
    ref = reference_logprobs(model, ctx.layout.ids)
    assert torch.allclose(d.logprobs, ref, atol=LOGPROB_TOL)
    assert d.top1 == CANDS[int(d.scores.argmax())]
    assert d.owned == (int(ref.argmax()) in {int(tok(" yes", add_special_tokens=False).input_ids[0]),
                                             int(tok(" no", add_special_tokens=False).input_ids[0])})


def test_fields_render_once_without_their_label(model, tok):
    ctx = order_context(model, tok)
    ctx.prefill()
    assert ctx.text.count("shipped") == 1 and "the order status" not in ctx.text
    a, b = ctx.layout.fields["status"]
    assert tok.decode(ctx.layout.ids[a:b]).strip() == "shipped"


def test_in_place_refreshes_the_field_exactly_and_leaves_downstream_stale(model, tok):
    ctx = order_context(model, tok)
    ctx.prefill()
    stale = [l.keys.clone() for l in ctx.cache.layers]
    rep = ctx.edit("status", "pending", "in_place")
    assert rep.applied == "in_place" and rep.cost.tokens == 1 and ctx.fields["status"] == "pending"
    fresh = order_context(model, tok, "pending")
    fresh.prefill()
    a, b = ctx.layout.fields["status"]
    assert torch.equal(ctx.layout.ids, fresh.layout.ids)
    for l, (layer, ref) in enumerate(zip(ctx.cache.layers, fresh.cache.layers)):
        assert torch.allclose(layer.keys[:, :, a:b], ref.keys[:, :, a:b], atol=KV_TOL)
        assert torch.equal(layer.keys[:, :, :a], stale[l][:, :, :a])
        assert torch.equal(layer.keys[:, :, b:], stale[l][:, :, b:])       # downstream: the stale notes
    # downstream K/V of a re-prefill differ (the field is read downstream), so the edit is not a no-op
    assert not torch.allclose(ctx.cache.layers[-1].keys[:, :, b:], fresh.cache.layers[-1].keys[:, :, b:], atol=1e-3)


@pytest.mark.parametrize("mode", ["erratum", "full", "selective@100%"])
def test_modes_equal_a_prefill_of_the_prompt_they_hold(model, tok, mode):
    """Every mode that recomputes everything after its first change is exact: its decision equals a
    plain forward of the prompt it holds; selective over every downstream position is the full
    re-prefill."""
    ctx = order_context(model, tok)
    ctx.prefill()
    rep = ctx.edit("status", "pending", mode)
    d = ctx.decide(CANDS)
    assert torch.allclose(d.logprobs, reference_logprobs(model, ctx.layout.ids), atol=COMPOSE_TOL)
    if mode == "erratum":
        line = "[STATE UPDATE] the order status has changed to pending"
        assert line in ctx.text and ctx.text.index(line) < ctx.text.index("Can the customer")
        assert "Order status: shipped" in ctx.text
        assert 0 < rep.cost.tokens < ctx.layout.length - 1
    if mode == "selective@100%":
        fresh = order_context(model, tok, "pending")
        fresh.prefill()
        assert torch.equal(ctx.layout.ids, fresh.layout.ids)
        assert torch.allclose(d.logprobs, fresh.decide(CANDS).logprobs, atol=COMPOSE_TOL)


def test_field_plus_erratum_is_the_in_place_edit_then_the_erratum(model, tok):
    """The field refresh leaves the notes between field and erratum stale (not a re-prefill): the
    cache before the erratum is the in-place edit's, and the erratum's tokens are forwarded against it."""
    ctx, ip = order_context(model, tok), order_context(model, tok)
    ctx.prefill()
    ip.prefill()
    rep = ctx.edit("status", "pending", "field_plus_erratum")
    ip.edit("status", "pending", "in_place")
    at = ctx.text.index("[STATE UPDATE]")
    assert "Order status: pending" in ctx.text and at < ctx.text.index("Can the customer")
    n = int((ctx.layout.ids[:ip.layout.length] != ip.layout.ids).nonzero()[0])       # first erratum token
    assert rep.cost.tokens == 1 + ctx.layout.length - 1 - n
    for layer, ref in zip(ctx.cache.layers, ip.cache.layers):
        assert torch.equal(layer.keys[:, :, :n], ref.keys[:, :, :n])
    # and not a re-prefill of its own prompt (the notes stay stale), unless every layer's window
    # (Mistral's 8 here) hides them from the decision
    assert all_sliding(model) or not torch.allclose(ctx.decide(CANDS).logprobs, reference_logprobs(model, ctx.layout.ids), atol=COMPOSE_TOL)


def test_append_and_a_new_request_are_exact(model, tok):
    ctx = order_context(model, tok)
    ctx.prefill()
    n = ctx.layout.length
    c1 = ctx.append("\nNote: the customer called twice.")
    c2 = ctx.set_request("\nShould the order be refunded? Answer yes or no.")
    assert 0 < c1.tokens < n and 0 < c2.tokens < ctx.layout.length
    assert ctx.text.index("called twice") < ctx.text.index("refunded") and "cancel order" not in ctx.text
    assert torch.allclose(ctx.decide(CANDS).logprobs, reference_logprobs(model, ctx.layout.ids), atol=COMPOSE_TOL)
    assert ctx.set_request("\nShould the order be refunded? Answer yes or no.").tokens == 0     # unchanged: no forward


def test_a_value_that_changes_the_length_is_re_prefilled_from_the_field(model, tok):
    ctx = order_context(model, tok)
    ctx.prefill()
    n = ctx.layout.length
    rep = ctx.edit("status", "awaiting payment confirmation", "in_place")
    assert rep.applied == "reprefill_from_field" and ctx.layout.length > n
    a, _ = ctx.layout.fields["status"]
    assert rep.cost.tokens == ctx.layout.length - 1 - a
    assert torch.allclose(ctx.decide(CANDS).logprobs, reference_logprobs(model, ctx.layout.ids), atol=COMPOSE_TOL)


def test_stale_and_diagnose_leave_the_cache_alone(model, tok):
    ctx = order_context(model, tok)
    ctx.prefill()
    ids, keys = ctx.layout.ids.clone(), ctx.cache.layers[0].keys.clone()
    ctx.diagnose("status", "pending", CANDS)
    assert torch.equal(ctx.layout.ids, ids) and torch.equal(ctx.cache.layers[0].keys, keys)
    assert ctx.fields["status"] == "shipped"
    rep = ctx.edit("status", "pending", "stale")
    assert rep.cost.tokens == 0 and torch.equal(ctx.cache.layers[0].keys, keys)
    assert ctx.fields["status"] == "pending" and "shipped" in ctx.text


@pytest.mark.parametrize("check", ["field_plus_erratum", "selective@100%"])
def test_auto_applies_what_its_diagnosis_says(model, tok, check):
    for margin in (-1e9, 0.0, 1e9):
        ctx = order_context(model, tok)
        ctx.prefill()
        rep = ctx.edit("status", "pending", "auto", candidates=CANDS, margin=margin, check=check, rule="flip",
                       fallback="corrected")
        dg = rep.diagnosis
        gap = float(dg.corrected.scores[CANDS.index(dg.corrected.top1)] - dg.corrected.scores[CANDS.index(dg.in_place.top1)])
        assert dg.needs_erratum == (dg.corrected.top1 != dg.in_place.top1 and dg.corrected.owned and gap > margin)
        assert rep.applied == ("in_place" if not dg.needs_erratum else
                               "field_plus_erratum" if check == "field_plus_erratum" else rep.applied)
        expect = dg.corrected if dg.needs_erratum else dg.in_place
        assert torch.allclose(ctx.decide(CANDS).logprobs, expect.logprobs, atol=LOGPROB_TOL)
        if margin == 1e9:
            assert not dg.needs_erratum and rep.applied == "in_place"


def test_auto_falls_back_to_a_re_prefill(model, tok):
    """With the defaults (selective@50%, extrapolated, fallback full) an edit judged insufficient is
    re-prefilled: its decision is the full re-prefill's; one judged sufficient is the in-place edit."""
    for margin in (-1e9, 1e9):
        ctx = order_context(model, tok)
        ctx.prefill()
        rep = ctx.edit("status", "pending", "auto", candidates=CANDS, margin=margin)
        assert rep.diagnosis.check == "selective@50%" and rep.diagnosis.rule == "extrapolate"
        fresh = order_context(model, tok, "pending")
        fresh.prefill()
        if margin < 0:
            assert rep.diagnosis.needs_erratum and rep.applied == "full"
            assert torch.allclose(ctx.decide(CANDS).logprobs, fresh.decide(CANDS).logprobs, atol=COMPOSE_TOL)
            assert rep.cost.tokens > fresh.layout.length - 1                       # diagnostic + re-prefill
        else:
            assert not rep.diagnosis.needs_erratum and rep.applied == "in_place"


def test_verdict_rules():
    """The two rules on hand-made decisions: a corrected arm that recomputed a quarter of the
    downstream and moved the log-odds of "no" from -2 to -1 extrapolates to +2 (needs more); the
    flip rule sees no flip."""
    from kvnotes.context import Decision, verdict

    empty = torch.zeros(0)
    ip = Decision(("yes", "no"), torch.tensor([-0.1, -2.1]), "yes", True, empty)
    cor = Decision(("yes", "no"), torch.tensor([-0.3, -1.3]), "yes", True, empty)
    assert verdict(ip, cor, "flip")[0] is False
    needs, reason = verdict(ip, cor, "extrapolate", 0.0, 0.25)
    assert needs and "2.000" in reason
    assert verdict(ip, cor, "extrapolate", 2.5, 0.25)[0] is False
    assert verdict(ip, cor, "extrapolate", 0.0, 1.0)[0] is False                # no extrapolation at share 1
    flipped = Decision(("yes", "no"), torch.tensor([-1.5, -0.4]), "no", True, empty)
    assert verdict(ip, flipped, "flip", 1.0)[0] is True and verdict(ip, flipped, "flip", 1.2)[0] is False
    unowned = Decision(("yes", "no"), torch.tensor([-1.5, -0.4]), "no", False, empty)
    assert verdict(ip, unowned, "flip")[0] is False
    for bad in [lambda: verdict(ip, cor, "vote"), lambda: verdict(ip, cor, "extrapolate", 0.0, 0.0)]:
        with pytest.raises(KvnotesError):
            bad()


def test_chunks_are_precompiled_once_and_a_full_seam_equals_the_prefill(model, tok):
    doc = "Shipping policy: parcels leave the warehouse within two days of payment."
    store: dict = {}

    def build(seam):
        ctx = EditableContext(model, tok, "Answer:", chunk_store=store, seam=seam)
        ctx.add_text("Order status: ").add_field("status", "shipped").add_text(".\n").add_chunk(doc)
        ctx.add_request("\nCan the customer still cancel? Answer yes or no.")
        return ctx

    whole = build(0)
    cost_full = whole.prefill(compose_chunks=False)
    ref = whole.decide(CANDS).logprobs
    first = build(0)
    c1 = first.prefill()
    assert doc in store and torch.equal(first.layout.ids, whole.layout.ids)
    second = build(0)
    c2 = second.prefill()
    n_doc = len(store[doc])
    assert c2.tokens == c1.tokens - n_doc - 1 == cost_full.tokens - n_doc      # reused: the chunk is not forwarded
    # spliced, not recomputed (visible to the decision unless every layer's window hides the chunk)
    assert all_sliding(model) or not torch.allclose(second.decide(CANDS).logprobs, ref, atol=COMPOSE_TOL)
    repaired = build(n_doc)
    repaired.prefill()
    assert torch.allclose(repaired.decide(CANDS).logprobs, ref, atol=COMPOSE_TOL)
    # an edit after composition recomputes from the field on: exact again
    second.edit("status", "awaiting payment confirmation", "in_place")
    assert torch.allclose(second.decide(CANDS).logprobs, reference_logprobs(model, second.layout.ids), atol=COMPOSE_TOL)


def test_bad_input_gets_one_line(model, tok):
    ctx = order_context(model, tok)
    for call, pattern in [(lambda: ctx.edit("status", "x"), "prefill"),
                          (lambda: ctx.add_field("status", "y"), "already"),
                          (lambda: ctx.add_field("other", ""), "non-empty")]:
        with pytest.raises(KvnotesError, match=pattern) as exc:
            call()
        assert "\n" not in str(exc.value)
    ctx.prefill()
    for call, pattern in [(lambda: ctx.edit("colour", "red"), "no field 'colour'"),
                          (lambda: ctx.edit("status", "pending", "teleport"), "unknown edit mode"),
                          (lambda: ctx.edit("status", "pending", "auto"), "candidates"),
                          (lambda: ctx.diagnose("status", "pending", CANDS, check="stale"), "unknown diagnostic"),
                          (lambda: ctx.diagnose("status", "pending", CANDS, rule="vote"), "unknown diagnostic rule"),
                          (lambda: ctx.edit("status", "pending", "auto", candidates=CANDS, fallback="x"), "fallback"),
                          (lambda: ctx.decide([" yes", " yes indeed"]), "first token"),
                          (lambda: ctx.decide([" yes"]), "two candidates"),
                          (lambda: ctx.add_text("more"), "before prefill")]:
        with pytest.raises(KvnotesError, match=pattern) as exc:
            call()
        assert "\n" not in str(exc.value)


def test_parse_mode():
    assert parse_mode("selective@16") == ("selective", 16)
    assert parse_mode("selective@25%") == ("selective", 0.25)
    assert parse_mode("auto") == ("auto", None)
    for bad in ("selective", "selective@", "selective@150%", "erratum@3"):
        with pytest.raises(KvnotesError):
            parse_mode(bad)


def docs_example() -> str:
    """The worked example of docs/context.md (its first python block)."""
    text = (ROOT / "docs" / "context.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_the_docs_example_runs_on_the_embedded_models(name, capsys):
    code = docs_example().replace('MODEL = "smollm2-135m"', f'MODEL = "{name}"')
    scope: dict = {}
    exec(compile(code, "docs/context.md", "exec"), scope)
    ctx, reports = scope["ctx"], scope["reports"]
    assert {r.mode for r in reports} == {"in_place", "erratum", "auto"}
    assert ctx.fields["status"] == "pending"
    out = capsys.readouterr().out
    assert "in_place" in out and "auto" in out
