"""The KV connector's arms of the serving benchmark (:mod:`kvnotes.serving.connector`): their
requests, and the store entries they are served from, computed with the harness's model.

- ``composed``: a RAG-shaped prompt. The system message holds the shared document
  (:func:`kvnotes.serving.trace.shared_document`) as ``chunk_tokens``-token chunks, in an order drawn
  per request; the instance's user message (its field, the request) follows. The store holds the
  prompt's head (template and system header, a full prefill) and every chunk precompiled once
  behind that head as its sink (:func:`kvnotes.ops.chunk.precompile`); a request's plan is the head
  then its chunks, each moved by RoPE to where it stands, and the engine computes the user message.
- ``composed_cold``: the same prompts by a full prefill (a per-request cache salt): the baseline.
- ``edited``: the ``in_place`` trace's prompts (:func:`kvnotes.serving.trace.build_trace`). The store
  holds each session's turn-0 prompt (a full prefill) and, per later turn, the new field value's K/V
  computed over that prompt's prefix (the paper's in-place edit: the field refreshed, everything after
  it stale; the refreshed span is where the two prompts' tokens differ, so tokens a new value shares
  with the old one at its ends are kept); the plan is the stale prompt with the refreshed field, up
  to the request line, which the engine computes. Turn 0 is sent without a plan. Its baseline is the trace's ``cold`` arm (the
  same prompts, full prefill).

Every request is a :class:`kvnotes.serving.trace.Request` whose ``plan`` and ``salt`` say how to
send it (:func:`kvnotes.serving.store.plan_request`).
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import replace

import numpy as np
import torch

from kvnotes.errors import KvnotesError
from kvnotes.harness.edit_prompts import DEFAULT_ORDER, user_pieces
from kvnotes.harness.tokens import Prompt, continuation_ids
from kvnotes.kv.cache import AllSlotCache
from kvnotes.models.text import tokenize
from kvnotes.serving.store import ChunkStore, Segment, plan_request
from kvnotes.serving.trace import (CANDIDATE_MERGES, Request, _common_prefix, _prompt, build_trace, pick_sessions, place,
                                   session_values, shared_document)

#: The arms this module builds, and the baseline each is compared with (same prompts, full prefill).
CONNECTOR_ARMS = ("composed", "composed_cold", "edited")
BASELINE = {"composed": "composed_cold", "edited": "cold"}
_MARK = "\u2063kvnotes-chunks\u2063"


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [int(i) for i in enc["input_ids"]], [tuple(o) for o in enc["offset_mapping"]]


@torch.no_grad()
def _prefill(model, ids: list[int], cache=None, start: int = 0):
    """K/V of ``ids`` at positions ``start ..`` over ``cache`` (extended in place); per layer
    ``[kv_heads, n, head_dim]`` of the new tokens."""
    cache = AllSlotCache() if cache is None else cache
    x = torch.tensor([ids], device=model.device)
    pos = torch.arange(start, start + len(ids), device=model.device).view(1, -1)
    model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, [l.keys[0, :, start:] for l in cache.layers], [l.values[0, :, start:] for l in cache.layers]


def _chunks(tokenizer, sentences: list[str], chunk_tokens: int) -> list[list[int]]:
    """The document's sentences grouped into chunks of about ``chunk_tokens`` tokens, each tokenised alone."""
    out, cur, n = [], [], 0
    for s in sentences:
        cur.append(s)
        n += len(_encode(tokenizer, " " + s)[0])
        if n >= chunk_tokens:
            out.append(_encode(tokenizer, " " + " ".join(cur))[0])
            cur, n = [], 0
    if cur:
        out.append(_encode(tokenizer, " " + " ".join(cur))[0])
    return out


def composed_requests(model, tokenizer, scenarios, store: ChunkStore, n_sessions: int, turns: int, doc_tokens: int,
                      chunk_tokens: int, seed: int = 0, template_kwargs: dict | None = None,
                      cold: bool = True) -> tuple[list[Request], list[dict], dict]:
    """The ``composed`` (and ``composed_cold``) requests, their store entries registered.

    Returns:
        (requests, exclusions, ``{register_s, n_chunks, head_tokens, chunk_tokens}``): the
        requests' field ``position`` is ``"composed"``; ``register_s`` covers building the prompts and
        registering the head and every chunk.

    Raises:
        KvnotesError: the chat template does not keep the system message in one piece.
    """
    from kvnotes.ops.chunk import precompile

    t0 = time.perf_counter()
    sentences = shared_document(scenarios, tokenizer, doc_tokens, seed)
    chunks = _chunks(tokenizer, sentences, chunk_tokens)
    sessions = pick_sessions(scenarios, n_sessions, seed)
    head_ids: list[int] | None = None
    requests, excluded = [], []
    rng = np.random.default_rng([seed, 7])
    for base in sessions:
        sc = base.scenario
        inst = replace(base, scenario=replace(sc, system=f"{base.scenario.system or ''} {_MARK}".strip()))
        for t, value in enumerate(session_values(sc, turns)):
            prompt = _prompt(tokenizer, inst, value, "direct", DEFAULT_ORDER, None, template_kwargs)
            cut = prompt.text.find(_MARK)
            if cut < 0:
                raise KvnotesError("the chat template does not render the system message verbatim; "
                                   "the composed arm needs it to place the chunks")
            head = [int(i) for i in tokenize(tokenizer, prompt.text[:cut])[0]]
            if head_ids is None:
                head_ids = head
            elif head != head_ids:
                raise KvnotesError("the composed arm needs one prompt head (template and system header) for every session")
            tail_text = prompt.text[cut + len(_MARK):]
            tail, offsets = _encode(tokenizer, tail_text)
            order = [int(i) for i in rng.permutation(len(chunks))]
            ids = head + [i for j in order for i in chunks[j]] + tail
            tail_prompt = Prompt(tail_text, torch.tensor(tail), torch.tensor(offsets), (0, 0), (0, 0))
            cands = {o: continuation_ids(tokenizer, tail_prompt, c) for o, c in sc.candidates.items()}
            if any(c is None for c in cands.values()):
                excluded.append({"session": base.id, "arm": "composed", "position": "composed", "turn": t,
                                 "reason": CANDIDATE_MERGES})
                continue
            fa = prompt.field_chars[0] - cut - len(_MARK)
            field_token = len(ids) - len(tail) + next((k for k, (a, b) in enumerate(offsets) if b > fa), 0)
            segments = [Segment("head", 0, len(head))] + [Segment(f"chunk-{j}", 0, len(chunks[j])) for j in order]
            plan, salt = plan_request("composed", segments)
            expected = sc.outcome(value)
            req = Request("composed", "composed", base.id, sc.id, sc.family, t, value, sc.candidates[expected],
                          tuple(ids), field_token, {o: c[0] for o, c in cands.items()}, cands[expected][0],
                          plan, salt)
            requests.append(req)
            if cold:
                requests.append(replace(req, arm="composed_cold", plan=None, salt=f"cold-{uuid.uuid4().hex}"))
    if head_ids is None:
        raise KvnotesError("no composed request could be built")
    store.put("head", head_ids, *_prefill(model, head_ids)[1:], start=0)
    sink = torch.tensor(head_ids)
    for j, c in enumerate(chunks):
        ch = precompile(model, torch.tensor(c), sink_ids=sink)
        store.put(f"chunk-{j}", c, ch.keys, ch.values, ch.start)
    info = {"register_s": time.perf_counter() - t0, "n_chunks": len(chunks), "head_tokens": len(head_ids),
            "chunk_tokens": [len(c) for c in chunks]}
    return sorted(requests, key=lambda r: (r.arm, r.turn, r.session)), excluded, info


def _safe(session: str) -> str:
    """A session id as a store entry name (ids carry '/')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", session)


def _request_start(tokenizer, prompt: Prompt, inst, value: str) -> int:
    """Token index where the request line starts (the engine computes from there)."""
    pieces, _, _ = user_pieces(inst, value, "direct")
    at = prompt.text.rfind(pieces["request"])
    if at < 0:
        raise KvnotesError(f"{inst.scenario.source}: the request line is not in the rendered prompt")
    return next(k for k, (a, b) in enumerate(prompt.offsets.tolist()) if b > at)


def edited_requests(model, tokenizer, scenarios, store: ChunkStore, n_sessions: int, turns: int, doc_tokens: int,
                    position: str, seed: int = 0, template_kwargs: dict | None = None) -> tuple[list[Request], list[dict], dict]:
    """The ``edited`` requests (the ``in_place`` trace at ``position``), their entries registered.

    Returns:
        (requests, exclusions, ``{register_s, refresh_s: per-turn seconds of the field refresh}``).
    """
    t0 = time.perf_counter()
    trace, excluded = build_trace(tokenizer, scenarios, n_sessions, turns, doc_tokens, [position], ["in_place"],
                                  seed, template_kwargs=template_kwargs)
    document = shared_document(scenarios, tokenizer, doc_tokens, seed)
    by_session = {s.id: place(s, document, position) for s in pick_sessions(scenarios, n_sessions, seed)}
    out, refresh_s = [], []
    stored: dict[str, tuple] = {}
    for r in sorted(trace, key=lambda r: (r.session, r.turn)):
        inst = by_session[r.session]
        prompt = _prompt(tokenizer, inst, r.value, "direct", DEFAULT_ORDER, None, template_kwargs)
        if tuple(int(i) for i in prompt.ids) != r.ids:
            raise KvnotesError("the edited arm's prompt does not match the trace's")
        if r.turn == 0:
            name = f"{_safe(r.session)}-t0"
            cache, keys, values = _prefill(model, list(r.ids))
            store.put(name, r.ids, keys, values, 0)
            stored[r.session] = (name, r.ids, cache)
            out.append(replace(r, arm="edited"))
            continue
        if r.session not in stored:
            continue
        name0, ids0, cache0 = stored[r.session]
        a = _common_prefix(ids0, r.ids)
        s = min(_common_prefix(ids0[::-1], r.ids[::-1]), min(len(ids0), len(r.ids)) - a)
        b, m = len(ids0) - s, len(r.ids) - s - a
        c = _request_start(tokenizer, prompt, inst, r.value)          # in the new prompt
        if not a + m <= c <= len(r.ids) - 1:
            excluded.append({"session": r.session, "arm": "edited", "position": position, "turn": r.turn,
                             "reason": "field_after_request"})
            continue
        t1 = time.perf_counter()
        prefix = AllSlotCache()
        for i, layer in enumerate(cache0.layers):
            prefix.update(layer.keys[:, :, :a], layer.values[:, :, :a], i)
        _, keys, values = _prefill(model, list(r.ids[a:a + m]), prefix, start=a)
        refresh_s.append(time.perf_counter() - t1)
        field = f"{_safe(r.session)}-t{r.turn}-field"
        store.put(field, r.ids[a:a + m], keys, values, a)
        segments = [Segment(name0, 0, a), Segment(field, 0, m), Segment(name0, b, b + (c - a - m))]
        segments = [g for g in segments if len(g) > 0]
        plan, salt = plan_request("edited", segments)
        out.append(replace(r, arm="edited", plan=plan, salt=salt))
    return out, excluded, {"register_s": time.perf_counter() - t0, "refresh_s": refresh_s}
