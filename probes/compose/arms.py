"""The ``compose`` probe's arms (paper §5; ``docs/probes/compose.md``): composed readouts of chunked
prompts, the full prefill and every composed variant ``(rotate, sink, seam)`` of the prompts of one
instance, batched in one :func:`kvnotes.ops.compose.compose` and read under the run's readout
(:func:`read_prompts`), the image-chunk arm (:func:`image_arm`), and the edit arms: editing inside a
composition, judged against a full prefill of the edited text (:func:`edit_arms`).
"""

from __future__ import annotations

import torch

from kvnotes.harness.chunks import CHUNKED_ORDER, FIELD_CHUNK_ORDER, layout_prompt, precompiled, prompt_parts, sink_ids
from kvnotes.harness.protocol import Measure
from kvnotes.harness.reader import PromptReader, Reads
from kvnotes.kv import cache as kvcache
from kvnotes.ops import compose as kvcompose
from kvnotes.ops import edit as kvedit


def variant_name(rotate: bool, sink: str, seam: int) -> str:
    """A composed variant's name in records: ``rotate/sink=bos/seam=4``, ``no_rotate/sink=none/seam=0``."""
    return f"{'rotate' if rotate else 'no_rotate'}/sink={sink}/seam={seam}"


def compose_variants(model, ids: torch.Tensor, prefix: torch.Tensor, chunks: tuple, variants: list[tuple[bool, str, int]],
                     chunk_memo: dict | None = None, **kw) -> tuple[dict, tuple]:
    """Every composed variant ``(rotate, sink, seam)`` of prompts that share their chunks, in one
    batched :func:`kvnotes.ops.compose.compose` (rows ``v * P + j``: variant ``v`` of prompt ``j``).

    Args:
        ids: ``[P, L]`` the prompts' tokens (the chunks and the sinks are read from the first).
        prefix: ``[P, L']`` the tokens composed (``ids`` or a prefix of them holding every chunk).
        chunk_memo: precompiled chunks by their tokens (:func:`kvnotes.harness.chunks.precompiled`).
        kw: passed to :func:`kvnotes.ops.compose.compose` (``static``).

    Returns:
        (sink -> its precompiled chunks, compose's ``(cache, logits)``).
    """
    first = chunks[0][0]
    compiled = {sink: [precompiled(model, ids[0, a:b], sink_ids(ids[0], sink, first), chunk_memo) for a, b in chunks]
                for sink in dict.fromkeys(v[1] for v in variants)}
    per_row = [v for v in variants for _ in range(ids.shape[0])]
    parts = prompt_parts(prefix.repeat(len(variants), 1), chunks,
                         [[compiled[sink][k] for _, sink, _ in per_row] for k in range(len(chunks))])
    return compiled, kvcompose.compose(model, parts, [r for r, _, _ in per_row], [s for _, _, s in per_row], **kw)


@torch.no_grad()
def read_prompts(model, reader: PromptReader, ids: torch.Tensor, chunks: tuple, variants: list[tuple[bool, str, int]],
                 chunk_memo: dict | None = None) -> list[dict]:
    """The full prefill and every composed variant of prompts that share their chunks (the prompts of
    one instance), read under the run's readout (:class:`kvnotes.harness.reader.PromptReader`).

    The full prefills read first, in one batch (:meth:`kvnotes.harness.reader.PromptReader.read_prompt`);
    a prompt whose full chain misses its marker is not composed. The rest are composed over what
    the readout feeds (:func:`compose_variants`: every variant of every prompt in one batched
    :func:`kvnotes.ops.compose.compose`; the whole prompt, or all but its last token, which the
    chains decode from) and read in one batch.

    Args:
        ids: ``[P, L]`` token ids of ``P`` prompts of equal length, identical at the chunk spans and
            before the first chunk; every chunk ends before ``L - 1``.
        chunks: token spans ``(a, b)`` of the chunks.
        variants: ``(rotate, sink, seam)`` of each composed variant (names :func:`variant_name`).
        chunk_memo: precompiled chunks by their tokens (:func:`kvnotes.harness.chunks.precompiled`),
            shared with :func:`edit_arms`.

    Returns:
        per prompt ``{"full": Reads, "variants": {name: Reads}}`` (one row each;
        :class:`kvnotes.harness.reader.Reads`); ``variants`` is empty when the full chain missed its
        marker; with :data:`FULL_SEAM` (the direct readout) also ``max_abs_logit_diff_full_seam``.

    Raises:
        ValueError: a generated readout of ``max_new_tokens > 0`` without a marker test, or from
            :func:`kvnotes.ops.compose.compose`.
        KvnotesError: an unknown sink (:func:`kvnotes.harness.chunks.sink_ids`); from
            :func:`kvnotes.ops.compose.compose` (a rope type without a delta rotation).
    """
    P = ids.shape[0]
    full = reader.read_prompt(ids)
    out: list[dict] = [{"full": full.take([j]), "variants": {}} for j in range(P)]
    keep = [j for j in range(P) if full.reached(j)]
    if not keep:
        return out
    sub, n = ids[keep], len(keep)
    compiled, (cache, logits) = compose_variants(model, sub, reader.fed(sub), chunks, variants, chunk_memo,
                                                 static=reader.static)
    comp = reader.read(cache, None, sub.repeat(len(variants), 1), logits=logits, label="composed")
    for i, v in enumerate(variants):
        for jj, j in enumerate(keep):
            out[j]["variants"][variant_name(*v)] = comp.take([i * n + jj])
    for j, check in zip(keep, FULL_SEAM.of(reader, model, sub, chunks, compiled[variants[0][1]], full.take(keep))
                        .get("max_abs_logit_diff_full_seam", [])):
        out[j]["max_abs_logit_diff_full_seam"] = check
    return out


def _full_seam(reader, model, ids: torch.Tensor, chunks: tuple, compiled: list, full: Reads) -> dict:
    """A check of the composition: the prompts composed with every chunk token recomputed (a seam
    of the longest chunk) against their full prefill, read at the decision position: per prompt the
    largest |logit difference|."""
    whole = max(b - a for a, b in chunks)
    _, check = kvcompose.compose(model, prompt_parts(ids, chunks, compiled), True, whole)
    assert full.logits is not None
    return {"max_abs_logit_diff_full_seam": [float((check[j] - full.logits[j]).abs().max()) for j in range(len(ids))]}


#: The whole-chunk seam's check reads raw logits at the decision position: the direct readout's
#: (summary: its largest difference over the prompts).
FULL_SEAM = Measure("full_seam", _full_seam, readouts=("direct",),
                    summary=lambda rows: {"max_abs_logit_diff_full_seam": max(
                        (r["max_abs_logit_diff_full_seam"] for r in rows), default=None)})


@torch.no_grad()
def image_arm(model, prompt_ids: torch.Tensor, spans: tuple, sinks: list[str], image: tuple) -> dict:
    """The image-chunk arm of one prompt: the image inserted after its first chunk.

    Args:
        prompt_ids: ``[T]`` the chunked prompt's tokens (ends at the decision position).
        spans: token spans of its chunks.
        image: ``(ids [n], inputs)`` of :func:`kvnotes.ops.mrope.synthetic_image`.

    Returns:
        ``{variant: {kl, top1_agree, logit_cosine}}`` vs the full prefill with the image encoded, for
        ``rotate`` / ``no_rotate`` x ``sinks`` at seam 0, and ``full_top1``.
    """
    from kvnotes.ops import mrope

    img, inputs = image
    n, at = len(img), spans[0][1]
    ids = torch.cat([prompt_ids[:at], img, prompt_ids[at:]])
    spans2 = [spans[0], (at, at + n)] + [(a + n, b + n) for a, b in spans[1:]]
    grid = inputs["image_grid_thw"]
    pos = mrope.positions(model, ids, image_grid_thw=grid)
    out = model(input_ids=ids.view(1, -1).to(model.device), position_ids=pos.unsqueeze(1), logits_to_keep=1, **inputs)
    full = out.logits[:, -1].float()
    rows = [(rot, sink) for rot in (True, False) for sink in sinks]
    compiled = {}
    for sink in sinks:
        before = sink_ids(ids, sink, spans2[0][0])
        compiled[sink] = [kvcompose.precompile(model, ids[a:b], before, **(inputs if (a, b) == spans2[1] else {}))
                          for a, b in spans2]
    parts = prompt_parts(ids.view(1, -1).expand(len(rows), -1), spans2,
                         [[compiled[sink][k] for _, sink in rows] for k in range(len(spans2))])
    _, logits = kvcompose.compose(model, parts, [r for r, _ in rows], 0)
    m = kvcompose.decision_metrics(full.expand(len(rows), -1), logits)
    res: dict = {variant_name(rot, sink, 0): {"kl": float(m["kl"][i]), "top1_agree": bool(m["top1_agree"][i]),
                                              "logit_cosine": float(m["logit_cosine"][i])}
                 for i, (rot, sink) in enumerate(rows)}
    return {"full_top1": int(full.argmax()), "variants": res}


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
            oracle), when the caller has it (:func:`read_prompts`' ``full`` log-probs); else computed.

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
