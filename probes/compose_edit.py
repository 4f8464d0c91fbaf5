"""The ``compose`` probe's edit arms: editing inside a composition (paper §4 on §5's composed
caches), judged against a full prefill of the **edited text**, never of the same tokens.

Specification: ``docs/probes/compose_edit.md``.
"""

from __future__ import annotations

import torch

from kvnotes.harness.chunks import CHUNKED_ORDER, FIELD_CHUNK_ORDER, layout_prompt, precompiled, prompt_parts
from kvnotes.harness.kit import summaries_by_family
from kvnotes.harness.stats import proportion
from kvnotes.kv import cache as kvcache
from kvnotes.ops import compose as kvcompose
from kvnotes.ops import edit as kvedit


def _vs_oracle(oracle: torch.Tensor, lp: torch.Tensor, cand_new: int) -> dict:
    """Per row of fp32 log-probs ``lp`` ``[R, vocab]`` against the oracle's ``[vocab]``: KL(oracle ||
    row), top-1 agreement, and whether the row's top-1 is the new value's candidate."""
    m = kvcompose.decision_metrics(oracle.expand_as(lp), lp)
    return {"kl": m["kl"].tolist(), "top1_agree": m["top1_agree"].tolist(),
            "correct": (lp.argmax(-1) == cand_new).tolist()}


@torch.no_grad()
def _stale_in_chunk(model, po, spans, seams: list[int], token: int, chunk_memo: dict | None) -> tuple[list, torch.Tensor]:
    """The stale composed caches of ``po`` over ``[0, d)`` (chunks at ``spans`` precompiled behind its
    first token, keys rotated), one per seam, built in one batched composition, and the decision
    log-probs ``[len(seams), vocab]`` of feeding ``token`` at ``d`` on each."""
    d = po.decision
    chunks = [precompiled(model, po.ids[a:b], po.ids[:1], chunk_memo) for a, b in spans]
    ids = po.ids[:d].view(1, -1).expand(len(seams), -1)
    cache, _ = kvcompose.compose(model, prompt_parts(ids, spans, chunks), True, seams,
                                 all_slots=True)        # the in-place edit needs every position
    stale = [kvcache.AllSlotCache.from_tensors([l.keys[r:r + 1, :, :d] for l in cache.layers],
                                               [l.values[r:r + 1, :, :d] for l in cache.layers])
             for r in range(len(seams))]
    return stale, kvedit.decision_logprobs_batch(model, stale, token, d)


@torch.no_grad()
def edit_arms(model, tok, pair, seams: list[int], template_kwargs: dict, chat_template: bool = True,
              memo: dict | None = None, new_full: torch.Tensor | None = None, turns: int | None = None) -> dict:
    """Editing inside a composition, judged against a full prefill of the **edited text** (the field
    rewritten to the new value), never of the same tokens.

    - ``erratum``: the old chunked prompt with the erratum of :mod:`kvnotes.harness.edit_prompts` (new value)
      inserted before the request; composed (chunks precompiled behind the prompt's first token,
      keys rotated, seams ``seams``) and, as a reference, fully prefilled. Oracle: the new chunked
      prompt (:mod:`kvnotes.harness.chunks` layout), fully prefilled.
    - ``field_in_chunk``: the layout ``rule, context, filler, request, decision`` with the rule and
      the context line (which holds the field) as chunks; the stale composed cache of the old
      prompt has its field refreshed with :func:`kvnotes.ops.edit.refresh_field` (``stale`` is the
      same cache unrefreshed). Oracle: the new prompt in that layout, fully prefilled.

    On a transcript suite (``turns``) the erratum is a line of the last user message before the
    request, and the field's chunk is the record's tool result
    (:func:`kvnotes.harness.chunks.layout_prompt`).

    Args:
        memo: work shared by the pairs of one instance (precompiled chunks, the field-chunk oracle
            of a new value, the stale caches of an old value); a new dict per instance.
        new_full: fp32 log-softmax ``[vocab]`` of the full prefill of ``pair.new`` (the erratum's
            oracle), when the caller has it (:func:`compose_prompts`' ``full``); else computed.

    Returns:
        ``{arm: {oracle_top1, oracle_owned, <method>: {kl, top1_agree, correct}}}`` or
        ``{arm: {"excluded": reason}}``; lists run over ``seams``.
    """
    from kvnotes.harness.edit_prompts import erratum_text

    memo = {} if memo is None else memo
    chunk_memo = memo.setdefault("chunks", {})
    inst, variant = pair.spec.instance, pair.spec.variant
    cn = pair.cand_new[0]
    out = {}
    # --- erratum appended to a composed cache
    made = layout_prompt(tok, inst, pair.spec.old, CHUNKED_ORDER, ("rule", "filler"), variant,
                         erratum_text(inst, pair.spec.new), chat_template, template_kwargs, turns)
    if isinstance(made, str) or made[1] != pair.chunks:
        out["erratum"] = {"excluded": made if isinstance(made, str) else "chunk_spans_differ"}
    else:
        prompt = made[0]
        oracle = torch.log_softmax(kvcompose.full_logits(model, pair.new.ids)[0], -1) if new_full is None else new_full
        chunks = [precompiled(model, prompt.ids[a:b], prompt.ids[:1], chunk_memo) for a, b in pair.chunks]
        ids = prompt.ids.view(1, -1).expand(len(seams), -1)
        _, comp = kvcompose.compose(model, prompt_parts(ids, pair.chunks, chunks), True, seams)
        full = kvcompose.full_logits(model, prompt.ids)
        top1 = int(oracle.argmax())
        out["erratum"] = {"oracle_top1": top1, "oracle_owned": top1 == cn,
                          "composed": _vs_oracle(oracle, torch.log_softmax(comp, -1), cn),
                          "full": _vs_oracle(oracle, torch.log_softmax(full, -1), cn)}
    # --- field refreshed inside a spliced chunk
    old = layout_prompt(tok, inst, pair.spec.old, FIELD_CHUNK_ORDER, ("rule", "context"), variant, None,
                        chat_template, template_kwargs, turns)
    new = layout_prompt(tok, inst, pair.spec.new, FIELD_CHUNK_ORDER, ("rule", "context"), variant, None,
                        chat_template, template_kwargs, turns)
    if isinstance(old, str) or isinstance(new, str):
        out["field_in_chunk"] = {"excluded": old if isinstance(old, str) else new}
        return out
    (po, so), (pn, sn) = old, new
    if len(po.ids) != len(pn.ids) or po.field != pn.field or so != sn:
        out["field_in_chunk"] = {"excluded": "unequal_field_length"}
        return out
    d = po.decision
    token = int(pn.ids[d])
    key = ("oracle", pair.spec.new, variant)
    if key not in memo:
        memo[key] = torch.log_softmax(kvcompose.full_logits(model, pn.ids)[0], -1)
    oracle = memo[key]
    key = ("stale", pair.spec.old, variant, token)
    if key not in memo:
        memo[key] = _stale_in_chunk(model, po, so, seams, token, chunk_memo)
    stale, stale_lp = memo[key]
    edited = [kvedit.refresh_field(model, c, pn.ids, pn.field).cache for c in stale]
    res = {"refreshed": kvedit.decision_logprobs_batch(model, edited, token, d), "stale": stale_lp}
    top1 = int(oracle.argmax())
    out["field_in_chunk"] = {"oracle_top1": top1, "oracle_owned": top1 == cn,
                             **{k: _vs_oracle(oracle, v, cn) for k, v in res.items()}}
    return out


def aggregate_arms(rows: list[dict], seams: list[int], families: list[str], n_boot: int, seed: int) -> dict:
    """Per arm, method and seam: agreement with the edited-text oracle on pairs whose oracle owns its
    decision, share with the new value's candidate as top-1 (accuracy), and mean KL(oracle || method)."""
    out = {}
    for arm, methods in (("erratum", ("composed", "full")), ("field_in_chunk", ("refreshed", "stale"))):
        rs = [r for r in rows if "excluded" not in r["arms"][arm]]
        out[arm] = {"n": len(rs), "excluded": len(rows) - len(rs)}
        for meth in methods:
            for i, seam in enumerate(seams):
                if arm == "erratum" and meth == "full" and i:
                    continue
                key = meth if (arm == "erratum" and meth == "full") else f"{meth}/seam={seam}"
                owned = [r for r in rs if r["arms"][arm]["oracle_owned"]]
                out[arm][key] = {
                    "agreement_owned": proportion(sum(r["arms"][arm][meth]["top1_agree"][i] for r in owned), len(owned)),
                    "accuracy": proportion(sum(r["arms"][arm][meth]["correct"][i] for r in rs), len(rs)),
                    "kl": summaries_by_family(rs, lambda r, a=arm, m=meth, i=i: r["arms"][a][m]["kl"][i], None,
                                              families, n_boot, seed)["all"]}
    return out
