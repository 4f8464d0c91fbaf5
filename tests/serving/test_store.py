"""The KV connector's chunk store and plans (kvnotes.serving.store), without an engine: what the
connector writes into vLLM's paged cache is :func:`assemble`'s output, so it is checked here against
kvnotes' own composition on every tiny architecture, and the engine's rotary module built from the
config alone against the loaded model's."""

from __future__ import annotations

import pytest
import torch

from kvnotes.ops.chunk import move, precompile
from kvnotes.serving.store import (ChunkStore, Rotations, Segment, assemble, check_plan, plan_request, plan_salt,
                                   plan_spec)
from tests.helpers import MLA_ARCHS, build_tiny

#: fp32 rotations of the same keys by two routes (one delta vs the chunk's own move).
ROTATION_TOL = 1e-5


def _stacked(tensors):
    return torch.stack([t[0] for t in tensors])


def _store(model, tmp_path, seed=0):
    """A head (8 tokens, full prefill) and two 6-token chunks precompiled behind it."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    head, a, b = (torch.randint(3, vocab, (n,), generator=g) for n in (8, 6, 6))
    store = ChunkStore(tmp_path / "store")
    h = precompile(model, head)
    store.put("head", head.tolist(), h.keys, h.values, h.start)
    chunks = {}
    for name, ids in (("a", a), ("b", b)):
        chunks[name] = precompile(model, ids, sink_ids=head)
        store.put(name, ids.tolist(), chunks[name].keys, chunks[name].values, chunks[name].start)
    return store, head, a, b, chunks


@pytest.mark.parametrize("arch", ["llama", "gemma3", *MLA_ARCHS[:1]])
def test_assembled_plan_is_kvnotes_composition(arch, tmp_path):
    """A plan (head, chunk b, chunk a) assembles to the head's K/V and each chunk moved to where it
    stands (:func:`kvnotes.ops.chunk.move`), with the rotary module built from the config alone
    (the engine's route, per layer type on Gemma-3, the rotary value slot on MLA) or the model's."""
    model = build_tiny(arch)
    store, head, a, b, chunks = _store(model, tmp_path)
    prompt = torch.cat([head, b, a, torch.tensor([5, 6])]).tolist()
    params, salt = plan_request("composed", [Segment("head", 0, 8), Segment("b", 0, 6), Segment("a", 0, 6)])
    plan = check_plan(store, params["kvnotes"], prompt, salt)
    assert not isinstance(plan, str), plan
    assert plan.n_tokens == 20
    moved_b, moved_a = move(model, chunks["b"], 8), move(model, chunks["a"], 14)
    assert chunks["a"].start == 8 and moved_a.start == 14
    want_k = torch.cat([_stacked(precompile(model, head).keys), _stacked(moved_b.keys), _stacked(moved_a.keys)], 2)
    want_v = torch.cat([_stacked(precompile(model, head).values), _stacked(moved_b.values), _stacked(moved_a.values)], 2)
    for rotations in (Rotations(model), Rotations.from_config(model.config)):
        k, v = assemble(store, plan, rotations, 0, 20)
        torch.testing.assert_close(k, want_k, atol=ROTATION_TOL, rtol=0)
        torch.testing.assert_close(v, want_v, atol=ROTATION_TOL, rtol=0)
        k2, v2 = assemble(store, plan, rotations, 11, 17)         # a window across the b/a seam
        torch.testing.assert_close(k2, want_k[:, :, 11:17], atol=ROTATION_TOL, rtol=0)
        torch.testing.assert_close(v2, want_v[:, :, 11:17], atol=ROTATION_TOL, rtol=0)
    slot = "values" if arch in MLA_ARCHS else "keys"
    moved = want_k if slot == "keys" else want_v
    unmoved = _stacked(chunks["a"].keys if slot == "keys" else chunks["a"].values)
    assert (moved[:, :, 14:20] - unmoved).abs().max() > 100 * ROTATION_TOL     # the move did rotate


def test_plan_checks_refuse_with_one_reason(tmp_path):
    """Every way a plan can be wrong is refused with its reason; a refused plan is never loaded."""
    model = build_tiny("llama")
    store, head, a, b, _ = _store(model, tmp_path)
    prompt = torch.cat([head, a, torch.tensor([9])]).tolist()
    segs = [Segment("head", 0, 8), Segment("a", 0, 6)]
    params, salt = plan_request("composed", segs)
    spec = params["kvnotes"]
    assert check_plan(store, spec, prompt, salt).n_tokens == 14
    assert salt == plan_salt(plan_spec("composed", segs)) != plan_salt(plan_spec("edited", segs))
    cases = {
        "cache_salt": (spec, prompt, None),
        "no store entry 'zz'": (plan_spec("composed", [Segment("zz", 0, 3)]), prompt, salt),
        "outside its 6 tokens": (plan_spec("composed", [Segment("head", 0, 8), Segment("a", 0, 7)]), prompt, salt),
        "is not the prompt's tokens 8..13": (plan_spec("composed", [Segment("head", 0, 8), Segment("b", 0, 6)]),
                                             prompt, salt),
        "covers all 14 prompt tokens": (spec, prompt[:14], salt),
        "malformed plan": ({"path": "other", "segments": []}, prompt, salt),
        "malformed segment": ({"path": "composed", "segments": [["head", 0]]}, prompt, salt),
        "bad store entry name": (plan_spec("composed", [Segment("../x", 0, 1)]), prompt, salt),
    }
    for reason, (sp, ids, s) in cases.items():
        got = check_plan(store, sp, ids, s)
        assert isinstance(got, str) and reason in got, (reason, got)


def test_store_replaces_an_entry_and_reads_it_anew(tmp_path):
    """A re-registered entry is read anew (metadata and tensors are memoised per file version)."""
    store = ChunkStore(tmp_path)
    k = torch.randn(2, 1, 3, 4)
    store.put("x", [1, 2, 3], k, k + 1, 5)
    assert store.meta("x").ids == (1, 2, 3) and store.meta("x").start == 5
    torch.testing.assert_close(store.tensors("x")[1], k + 1)
    store.put("x", [7, 8], [t[:, :2] for t in (k * 2).unbind(0)], [t[:, :2] for t in k.unbind(0)], 0)
    assert store.meta("x").ids == (7, 8)
    torch.testing.assert_close(store.tensors("x")[0], (k * 2)[:, :, :2])
    assert store.meta("missing") is None


def test_connector_table_reads_the_rows():
    """The connector arms' table: the speedups are the baseline's p90 over the arm's (client and
    engine TTFT), over the planned requests only, with the answers and KL of those requests."""
    from kvnotes.records.tables import serving_table
    from kvnotes.serving.trace import aggregate, summarize_run

    def row(arm, turn, ttft, engine, kl=None, agree=True):
        return {"arm": arm, "position": "composed", "rate": 1.0, "turn": turn, "sent": True, "n_prompt": 100,
                "n_cached": 90 if kl is not None else 0, "loaded_tokens": 90 if kl is not None else 0,
                "ttft_s": ttft, "engine_first_token_latency_s": engine, "send_s": 0.0, "finish_s": 1.0,
                "owned": True, "served_correct": agree, "agree": agree, "max_abs_diff_candidates": 0.0,
                "kl_first_token": kl, "path": "composed" if kl is not None else "full_prefill"}

    rows = [row("composed", t, 0.1 * (t + 1), 0.05 * (t + 1), kl=0.01 * t, agree=t != 2) for t in range(3)]
    rows += [row("composed_cold", t, 2.0 + t, 1.0 + t) for t in range(3)]
    runs = [{"arm": a, "position": "composed", "rate": 1.0, "reset_ok": True, "first_request_cached_tokens": 0,
             **summarize_run([r for r in rows if r["arm"] == a], 1.0)} for a in ("composed", "composed_cold")]
    res = {"rows": rows, "runs": runs, "aggregates": aggregate(runs), "engine": {"block_size": 16},
           "cross_check": {"rows": [], "max_abs_diff_candidates": 0.0, "max_abs_diff_vocab": 0.0,
                           "tolerance_nats": 0.01, "all_top1_equal": True}}
    rec = {"model": {"name": "m"}, "packages": {"vllm": "0"}, "scenario": {"n_scenarios": 1, "families": ["f"]},
           "config": {"sessions": 1, "turns": 3, "doc_tokens": 10}, "result": res}
    line = [x for x in serving_table(rec).splitlines() if x.startswith("| 1 | composed |")][-1]   # the connector table
    cells = [c.strip() for c in line.strip("|").split("|")]
    # p90 of 0.1/0.2/0.3 is 0.28 and of 2/3/4 is 3.8 (linear); engine: 0.14 and 2.8
    assert cells[2] == "3" and cells[4] == "composed 3" and cells[5] == "0.900"
    assert cells[8] == f"{3.8 / 0.28:.1f}x" and cells[11] == f"{2.8 / 0.14:.1f}x"
    assert cells[12] == "2/3" and cells[14] == "0.01 / 0.02"
