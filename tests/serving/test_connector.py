"""kvnotes' KV connector inside vLLM's CPU engine (kvnotes.serving.connector), on the embedded
SmolLM2: composed and edited requests served with their provenance labels and checked against the
harness's own composition / edit and its full prefill, and approximate blocks never served to an
exact request. Needs the serving environment::

    .venv-serving/bin/python -m pytest -m serving tests/serving/test_connector.py
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: nats, whole vocabulary: vLLM's CPU attention over paged blocks vs transformers' SDPA, both fp32,
#: on the same K/V (fp32 rounding through 30 layers, ~5e-5 measured); a wrong layout, position or
#: stale block moves log-probs by whole nats.
ENGINE_TOL = 1e-3

pytestmark = pytest.mark.serving


def _logprobs(out, vocab):
    import torch

    lp = torch.full((vocab,), float("nan"))
    for tok, v in out.outputs[0].logprobs[0].items():
        lp[tok] = v.logprob
    return lp


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The harness model, a store with the composed and edited arms' entries, and an engine with the connector."""
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from omegaconf import OmegaConf

    from kvnotes.models.loading import load_model, materialise_embedded
    from kvnotes.scenarios import load_suite
    from kvnotes.serving.arms import composed_requests, edited_requests
    from kvnotes.serving.store import ChunkStore

    cfg = OmegaConf.load(ROOT / "conf" / "model" / "smollm2-135m.yaml")
    bundle = load_model(cfg, "cpu")
    scs = load_suite([str(ROOT / "scenarios/suites")], ids=["home_city"])
    root = tmp_path_factory.mktemp("store")
    store = ChunkStore(root)
    composed, _, _ = composed_requests(bundle.model, bundle.tokenizer, scs, store, 1, 2, 300, 64, cold=False)
    edited, _, _ = edited_requests(bundle.model, bundle.tokenizer, scs, store, 1, 2, 200, "early")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    source = str(materialise_embedded(cfg.embedded)[0])
    ktc = KVTransferConfig(kv_connector="KvnotesConnector", kv_role="kv_both",
                           kv_connector_module_path="kvnotes.serving.connector",
                           kv_connector_extra_config={"store": str(root)})
    llm = LLM(model=source, tokenizer=source, dtype="float32", max_model_len=2048, enable_prefix_caching=True,
              enforce_eager=True, max_logprobs=-1, kv_transfer_config=ktc, seed=0)
    yield bundle, store, composed, edited, llm
    llm.llm_engine.engine_core.shutdown()


def _serve(llm, ids, vocab, plan=None, salt=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(ids))
    if salt:
        prompt["cache_salt"] = salt
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, detokenize=False,
                            extra_args={"kv_transfer_params": plan} if plan else None)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return out, _logprobs(out, vocab), out.kv_transfer_params or {}


def _harness_plan(model, store, plan, ids):
    """The harness's answer under a plan: the segments' K/V moved with kvnotes.kv.rope.reposition into a
    transformers cache, the rest of the prompt forwarded over it; fp32 log-probs ``[vocab]``."""
    import torch
    from transformers import DynamicCache

    from kvnotes.kv.rope import reposition

    layers_k, layers_v, at = None, None, 0
    for name, begin, end in plan["kvnotes"]["segments"]:
        k, v = store.tensors(name)
        keys = [t[None, :, begin:end] for t in k]
        values = [t[None, :, begin:end] for t in v]
        delta = at - (store.meta(name).start + begin)
        if delta:
            keys, values = reposition(model, keys, values, delta)
        layers_k = keys if layers_k is None else [torch.cat([a, b], 2) for a, b in zip(layers_k, keys)]
        layers_v = values if layers_v is None else [torch.cat([a, b], 2) for a, b in zip(layers_v, values)]
        at += end - begin
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(layers_k, layers_v)):
        cache.update(k, v, i)
    from kvnotes.serving.trace import _continued_logprobs

    return _continued_logprobs(model, cache, at, tuple(ids))


def test_composed_request_is_served_composed_and_never_poisons_exact_requests(served):
    """A composed request is served from the store (label ``composed``, every plan token loaded) and
    answers as the harness's own composition does; the same tokens sent exactly afterwards hit none
    of its blocks and answer as the full prefill; a plan without its salt is refused; the same plan
    again reuses its own (salted) blocks."""
    from kvnotes.serving.trace import first_token_kl, full_prefill_logprobs

    bundle, store, composed, _, llm = served
    model, vocab = bundle.model, bundle.model.config.vocab_size
    r = composed[0]
    n_plan = sum(e - b for _, b, e in r.plan["kvnotes"]["segments"])
    full = full_prefill_logprobs(model, r.ids)
    harness = _harness_plan(model, store, r.plan, r.ids)

    out, lp, kv = _serve(llm, r.ids, vocab, r.plan, r.salt)
    assert kv["kvnotes_path"] == "composed" and kv["kvnotes_loaded"] == n_plan and kv["kvnotes_local"] == 0
    assert (lp - harness).abs().max() < ENGINE_TOL
    assert int(lp.argmax()) == int(harness.argmax())
    kl = first_token_kl(full, {t: float(lp[t]) for t in range(vocab)})
    assert math.isfinite(kl) and kl > 0
    assert (lp - full).abs().max() > 10 * ENGINE_TOL            # composition is approximate: the checks below can fail

    out, exact, kv = _serve(llm, r.ids, vocab)
    assert kv["kvnotes_path"] == "full_prefill" and out.num_cached_tokens == 0
    assert (exact - full).abs().max() < ENGINE_TOL

    out, refused, kv = _serve(llm, r.ids, vocab, r.plan, None)
    assert kv["kvnotes_path"] == "prefix_hit" and "cache_salt" in kv["kvnotes_refused"] and kv["kvnotes_loaded"] == 0
    assert (refused - full).abs().max() < ENGINE_TOL

    out, again, kv = _serve(llm, r.ids, vocab, r.plan, r.salt)
    assert kv["kvnotes_path"] == "composed" and kv["kvnotes_local"] > 0
    assert kv["kvnotes_loaded"] == max(n_plan - kv["kvnotes_local"], 0)    # its blocks may reach past the plan
    assert (again - lp).abs().max() < ENGINE_TOL


def test_edited_request_is_the_harness_edit(served):
    """An exact plan (the stored prompt's own K/V) reproduces the full prefill: the paged layout is
    right. An edited request (the turn-0 K/V with the new field's K/V) is labelled ``edited`` and
    answers as the harness's same edit does."""
    from kvnotes.serving.store import Segment, plan_request
    from kvnotes.serving.trace import full_prefill_logprobs

    bundle, store, _, edited, llm = served
    model, vocab = bundle.model, bundle.model.config.vocab_size
    turn0 = next(r for r in edited if r.turn == 0)
    name = edited[1].plan["kvnotes"]["segments"][0][0]
    plan, salt = plan_request("edited", [Segment(name, 0, len(turn0.ids) - 1)])
    _, lp, kv = _serve(llm, turn0.ids, vocab, plan, salt)
    assert kv["kvnotes_path"] == "edited" and kv["kvnotes_loaded"] == len(turn0.ids) - 1
    assert (lp - full_prefill_logprobs(model, turn0.ids)).abs().max() < ENGINE_TOL

    r = next(r for r in edited if r.turn == 1)
    n_plan = sum(e - b for _, b, e in r.plan["kvnotes"]["segments"])
    assert n_plan < len(r.ids) - 1                                # the request line is the engine's
    _, lp, kv = _serve(llm, r.ids, vocab, r.plan, r.salt)
    assert kv["kvnotes_path"] == "edited" and kv["kvnotes_loaded"] == n_plan
    harness = _harness_plan(model, store, r.plan, r.ids)
    assert (lp - harness).abs().max() < ENGINE_TOL
    assert int(lp.argmax()) == int(harness.argmax())


#: K/V computed by the engine vs by transformers, fp32, same weights (per element, through 30 layers).
CAPTURE_TOL = 1e-3


def test_capture_from_an_engine_pass(served):
    """A capture request writes the engine's own K/V of its first tokens as a store entry before it
    returns; they match the harness's prefill of the same tokens, and a plan over the captured entry
    reproduces the full prefill. A capture under a bad name is refused with its reason."""
    import torch

    from kvnotes.serving.store import Segment, capture_request, plan_request
    from kvnotes.serving.trace import full_prefill_logprobs

    bundle, store, _, edited, llm = served
    model, vocab = bundle.model, bundle.model.config.vocab_size
    turn0 = next(r for r in edited if r.turn == 0)
    stored = edited[1].plan["kvnotes"]["segments"][0][0]          # the harness's prefill of turn 0
    n = len(turn0.ids) - 1
    _, lp, kv = _serve(llm, turn0.ids, vocab, capture_request("captured-t0", n), salt="fresh-capture")
    assert kv["kvnotes_capture"] == "captured-t0" and kv["kvnotes_path"] == "full_prefill"
    assert store.meta("captured-t0").ids == tuple(turn0.ids[:n]) and store.meta("captured-t0").start == 0
    got, want = store.tensors("captured-t0"), store.tensors(stored)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w[:, :, :n], atol=CAPTURE_TOL, rtol=0)
    plan, salt = plan_request("composed", [Segment("captured-t0", 0, n)])
    _, lp, kv = _serve(llm, turn0.ids, vocab, plan, salt)
    assert kv["kvnotes_path"] == "composed" and kv["kvnotes_loaded"] == n
    assert (lp - full_prefill_logprobs(model, turn0.ids)).abs().max() < ENGINE_TOL

    _, _, kv = _serve(llm, turn0.ids, vocab, capture_request("../escape", 3))
    assert "bad store entry name" in kv["kvnotes_capture_refused"] and "kvnotes_capture" not in kv
