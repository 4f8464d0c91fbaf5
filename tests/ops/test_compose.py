"""Composition invariants (kvnotes/ops/compose.py) on tiny random models of every adapter architecture,
Llama with llama3 / linear / YaRN rope scaling, and a partial-rotary architecture (StableLM)."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch
import transformers as T

from kvnotes.ops import compose
from kvnotes.models.adapters import Adapter
from kvnotes.errors import KvnotesError
from tests.helpers import ARCHS, VOCAB, WINDOW, build_tiny

# fp32 on CPU: a delta rotation of a post-RoPE key and the key computed at the shifted position
# differ only by fp32 rounding of angles up to ~256 rad and of the shifted forward (~1e-6 measured);
# 1e-4 leaves margin yet fails for a wrong theta, a missing/doubled YaRN scaling or a wrong rot_dim
# (those give differences of order 0.1-1).
KV_ATOL = 1e-4
# Logits after a few more layers on top of those keys: same rounding, amplified a little.
LOGIT_ATOL = 2e-4

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, num_hidden_layers=3)
SCALED = {
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}
EXTRA = ["llama3", "linear", "yarn", "stablelm"]


@cache
def build(name: str):
    """A tiny random model (built once per session; tests never modify weights)."""
    if name in ARCHS:
        return build_tiny(name)
    torch.manual_seed(0)
    if name in SCALED:
        cfg = T.LlamaConfig(rope_parameters=SCALED[name], **COMMON)
    elif name == "stablelm":       # partial rotary: a quarter of each head's dims are rotated
        cfg = T.StableLmConfig(**COMMON)
    else:
        raise ValueError(name)
    return T.AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module", params=ARCHS + EXTRA)
def model(request):
    return build(request.param)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(1, VOCAB, n)).long()


def test_reposition_equals_prefill_at_shifted_positions(model):
    """A chunk prefilled at 0..n-1 and rotated to p..p+n-1 equals the chunk prefilled at p..p+n-1
    (keys; values do not depend on the absolute position), in every layer, for random p."""
    ids = _ids(12, 1)                     # longer than the sliding window: windows fill inside the chunk
    base = compose.precompile(model, ids)
    for p in np.random.default_rng(2).integers(1, 200, 2):
        shifted = compose.precompile(model, ids, offset=int(p))
        rotated = compose.rotate_keys(model, base.keys, int(p))
        for l in range(len(base.keys)):
            assert (rotated[l] - shifted.keys[l]).abs().max() < KV_ATOL, (p, l)
            assert (base.values[l] - shifted.values[l]).abs().max() < KV_ATOL, (p, l)
        # the control is not trivially close: unrotated keys differ at the shifted positions
        assert max(float((k - s).abs().max()) for k, s in zip(base.keys, shifted.keys)) > 100 * KV_ATOL


def test_delta_rotation_is_per_layer_type_and_pure():
    """Gemma-3: sliding layers rotate with the local theta, full layers with the global one;
    YaRN: the attention scaling (!= 1) is divided out, so the rotation has unit norm per pair;
    StableLM: only the rotary dims are rotated."""
    g = build("gemma3")
    rots = compose.delta_rotations(g, 37)
    types = Adapter.for_model(g).layer_types
    by = {t: r for t, r in zip(types, rots)}
    assert not torch.allclose(by["sliding_attention"][0], by["full_attention"][0])
    y = build("yarn")
    assert abs(y.model.rotary_emb.attention_scaling - 1.0) > 0.05
    cos, sin = compose.delta_rotations(y, 37)[0]
    assert torch.allclose(cos ** 2 + sin ** 2, torch.ones_like(cos), atol=KV_ATOL)
    s = build("stablelm")
    cos, _ = compose.delta_rotations(s, 5)[0]
    head_dim = Adapter.for_model(s).head_dim
    assert cos.shape[-1] < head_dim
    keys = torch.randn(1, 2, 3, head_dim)
    out = compose.rotate_into(keys, *compose.delta_rotations(s, 5)[0], out=torch.empty_like(keys))
    assert torch.equal(out[..., cos.shape[-1]:], keys[..., cos.shape[-1]:])


def _isolated_chunk_mask(model, P: int, n: int, m: int) -> torch.Tensor | dict:
    """Additive 4-D masks ``[1, 1, L, L]`` for prefix | chunk | suffix where the chunk's rows see only
    the chunk (causally) and every other row is causal; sliding layers also get their window."""
    L = P + n + m
    q = torch.arange(L)[:, None]
    k = torch.arange(L)[None, :]
    allowed = k <= q
    in_chunk = (q >= P) & (q < P + n)
    allowed &= ~in_chunk | (k >= P)
    minus = torch.finfo(torch.float32).min

    def additive(ok):
        return torch.where(ok, 0.0, minus)[None, None]

    full, sliding = additive(allowed), additive(allowed & (q - k < WINDOW))
    types = set(Adapter.for_model(model).layer_types)
    if types == {"full_attention"}:
        return full
    if types == {"sliding_attention"}:
        return sliding
    return {"full_attention": full, "sliding_attention": sliding}


@torch.no_grad()
def test_splice_of_self_attending_chunk_equals_full_prefill(model):
    """Prefix + a chunk whose tokens attend only to themselves + suffix: the composed cache (chunk
    precompiled at 0 and rotated to P, suffix recomputed) gives the full prefill's logits and K/V."""
    P, n, m = 5, 6, 7
    prefix, chunk_ids, suffix = _ids(P, 3), _ids(n, 4), _ids(m, 5)
    ids = torch.cat([prefix, chunk_ids, suffix]).view(1, -1)
    ref = T.DynamicCache(config=model.config)
    out = model(input_ids=ids, position_ids=torch.arange(P + n + m)[None], past_key_values=ref, use_cache=True,
                attention_mask=_isolated_chunk_mask(model, P, n, m))
    chunk = compose.precompile(model, chunk_ids)
    cache, logits = compose.compose(model, [prefix, chunk, suffix])
    err = float((logits[0] - out.logits[0, -1]).abs().max())
    assert err < LOGIT_ATOL
    for lr, lc in zip(ref.layers, cache.layers):
        held = lr.keys.shape[2]           # sliding layers hold the last window - 1 positions
        kc, vc = lc.keys[:, :, :P + n + m], lc.values[:, :, :P + n + m]
        assert (kc[:, :, -held:] - lr.keys).abs().max() < KV_ATOL
        assert (vc[:, :, -held:] - lr.values).abs().max() < KV_ATOL
    # the no-rotate control does not give the full prefill: its chunk keys sit at the wrong
    # positions, and its logits are much further off (random tiny models barely use attention, so
    # the logit gap is compared with the method's own error rather than with a fixed size)
    ctrl_cache, ctrl = compose.compose(model, [prefix, chunk, suffix], rotate=False)
    kd = [float((lc.keys[:, :, P:P + n] - lr.keys[:, :, P:P + n]).abs().max())
          for lr, lc in zip(ref.layers, ctrl_cache.layers) if not getattr(lr, "is_sliding", False)]
    assert all(d > 100 * KV_ATOL for d in kd)
    assert float((ctrl[0] - out.logits[0, -1]).abs().max()) > 10 * max(err, 1e-6)


@torch.no_grad()
def test_full_seam_equals_full_prefill_batched_and_sinks():
    """Seam repair over the whole chunk recomputes it: equals the full causal prefill, for two
    chunks in a row, batched live parts, with a sink; static and dynamic caches agree."""
    for name in ("llama", "gemma3"):
        model = build(name)
        prefix = torch.stack([_ids(4, 6), _ids(4, 7)])
        c1, c2, suffix = _ids(5, 8), _ids(6, 9), _ids(3, 10)
        ids = torch.cat([prefix, c1.expand(2, -1), c2.expand(2, -1), suffix.expand(2, -1)], dim=1)
        ref = compose.full_logits(model, ids)
        chunks = [compose.precompile(model, c, sink_ids=prefix[0, :1]) for c in (c1, c2)]
        _, got = compose.compose(model, [prefix, *chunks, suffix], seam=99)
        assert (got - ref).abs().max() < LOGIT_ATOL
        if name == "llama":
            _, st = compose.compose(model, [prefix, *chunks, suffix], seam=2, static=True)
            _, dy = compose.compose(model, [prefix, *chunks, suffix], seam=2, static=False)
            assert (st - dy).abs().max() < LOGIT_ATOL
            with pytest.raises(ValueError):
                compose.compose(build("gemma3"), [prefix, *chunks, suffix], static=True)


def test_metrics_and_refused_rope_type():
    full = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 3.0]])
    m = compose.decision_metrics(full, full.clone())
    assert torch.allclose(m["kl"], torch.zeros(2), atol=1e-6) and m["top1_agree"].all()
    m = compose.decision_metrics(full, full.flip(-1))
    assert (m["kl"] > 0.1).all() and not m["top1_agree"][0]
    cfg = T.LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, **COMMON)
    dyn = T.AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(KvnotesError, match="rope type 'dynamic'"):
        compose.delta_rotations(dyn, 3)


@torch.no_grad()
def test_per_row_variants_equal_separate_runs():
    """One batched compose over rows with different sinks, seams and rotation gives each row what
    its own compose gives (static cache on Llama, sliding-aware dynamic cache on Gemma-3)."""
    for name in ("llama", "gemma3"):
        model = build(name)
        prefix, c1, mid, c2, suffix = _ids(4, 11), _ids(6, 12), _ids(2, 13), _ids(7, 14), _ids(5, 15)
        sinks = {"none": None, "bos": prefix[:1]}
        compiled = {k: [compose.precompile(model, c, v) for c in (c1, c2)] for k, v in sinks.items()}
        rows = [("none", True, 0), ("bos", True, 2), ("none", False, 4), ("bos", True, 99), ("bos", False, 1)]
        parts = [prefix, [compiled[k][0] for k, _, _ in rows], mid, [compiled[k][1] for k, _, _ in rows], suffix]
        _, batched = compose.compose(model, parts, rotate=[r for _, r, _ in rows], seam=[s for _, _, s in rows])
        for i, (k, rot, s) in enumerate(rows):
            _, alone = compose.compose(model, [prefix, compiled[k][0], mid, compiled[k][1], suffix], rot, s)
            assert (batched[i] - alone[0]).abs().max() < LOGIT_ATOL, (name, i)


ONE_PASS = ["llama", "qwen3", "llama3", "linear", "yarn", "stablelm"]     # no sliding-window layers


def _same_cache(a, b, L: int) -> bool:
    return all((la.keys[:, :, :L] - lb.keys[:, :, :L]).abs().max() < KV_ATOL
               and (la.values[:, :, :L] - lb.values[:, :, :L]).abs().max() < KV_ATOL
               for la, lb in zip(a.layers, b.layers))


@pytest.mark.parametrize("name", ONE_PASS)
@torch.no_grad()
def test_one_pass_equals_compose(name):
    """compose_one_pass (chunk K/V rotated by one GEMM into a slot cache, then ONE forward of every
    live and seam token) gives compose()'s logits and K/V: for seam 0 / partial / whole chunk, the
    no-rotate control, two chunks around a live middle part (three runs of positions) and two rows;
    the whole-chunk seam also equals the full prefill."""
    model = build(name)
    prefix, c1, mid, c2, suffix = _ids(5, 21), _ids(9, 22), _ids(2, 23), _ids(7, 24), _ids(4, 25)
    ch1, ch2 = compose.precompile(model, c1, sink_ids=prefix[:1]), compose.precompile(model, c2)
    assert ch1.stacked is not None and ch1.keys[0].data_ptr() == ch1.stacked[0][0].data_ptr()
    rows = torch.stack([prefix, _ids(5, 26)])
    cases = [([prefix, ch1, suffix], True, 0), ([prefix, ch1, suffix], True, 3), ([prefix, ch1, suffix], True, 99),
             ([prefix, ch1, suffix], False, 2), ([prefix, ch1, mid, ch2, suffix], True, 2),
             ([rows, ch1, suffix], True, 2), ([ch1, suffix], True, 1)]
    for parts, rot, seam in cases:
        L = sum(len(p) if isinstance(p, compose.Chunk) else p.shape[-1] for p in parts)
        ref_cache, ref = compose.compose(model, parts, rot, seam)
        cache, got = compose.compose_one_pass(model, parts, rot, seam)
        assert (got - ref).abs().max() < LOGIT_ATOL, (name, rot, seam)
        assert _same_cache(cache, ref_cache, L) and int(cache.get_seq_length()) == L
    full = compose.full_logits(model, torch.cat([prefix, c1, suffix]))
    _, whole = compose.compose_one_pass(model, [prefix, ch1, suffix], seam=99)
    assert (whole - full).abs().max() < LOGIT_ATOL
    # a chunk without stacked K/V (built elsewhere) takes the per-layer path
    loose = compose.Chunk(ch1.ids, [k.clone() for k in ch1.keys], [v.clone() for v in ch1.values], ch1.start, ch1.sink)
    _, a = compose.compose_one_pass(model, [prefix, loose, suffix], seam=2)
    _, b = compose.compose_one_pass(model, [prefix, ch1, suffix], seam=2)
    assert (a - b).abs().max() < LOGIT_ATOL


def test_rotation_matrix_equals_rotate_into():
    """keys @ rotation_matrix(cos, sin) == rotate_into(keys, cos, sin), partial rotary included."""
    for name in ("llama", "stablelm"):
        model = build(name)
        head_dim = Adapter.for_model(model).head_dim
        cos, sin = compose.delta_rotations(model, 41)[0]
        keys = torch.randn(2, 3, 5, head_dim)
        R = compose.rotation_matrix(cos, sin, head_dim)
        assert (keys @ R - compose.rotate_into(keys, cos, sin, torch.empty_like(keys))).abs().max() < KV_ATOL


@torch.no_grad()
def test_runner_reuses_its_pool():
    """ComposeRunner (eager on CPU): calls of different lengths on one pool, a short prompt after a
    long one, give what compose_one_pass gives on a fresh cache; a prompt ending in a chunk has no
    logits; sliding-window models and per-row values are refused."""
    model = build("qwen3")
    runner = compose.ComposeRunner(model, 40)
    prefix, suffix = _ids(4, 31), _ids(3, 32)
    long_chunk, short_chunk = compose.precompile(model, _ids(25, 33)), compose.precompile(model, _ids(6, 34))
    for ch, seam in [(long_chunk, 2), (short_chunk, 0), (short_chunk, 3), (long_chunk, 0)]:
        cache, got = runner([prefix, ch, suffix], True, seam)
        _, ref = compose.compose_one_pass(model, [prefix, ch, suffix], True, seam)
        assert (got - ref).abs().max() < LOGIT_ATOL
        assert cache is runner.cache and int(cache.get_seq_length()) == 4 + len(ch) + 3
    assert runner([prefix, short_chunk], True, 2)[1] is None
    with pytest.raises(ValueError):
        runner([prefix, long_chunk, _ids(20, 35)])         # longer than the pool
    with pytest.raises(ValueError):
        compose.compose_one_pass(model, [prefix, [short_chunk, short_chunk], suffix])
    with pytest.raises(ValueError):
        compose.compose_one_pass(model, [prefix, short_chunk, suffix], seam=[0, 1])
    with pytest.raises(ValueError):
        runner([prefix, short_chunk, suffix], rotate=[True])
    with pytest.raises(ValueError):
        compose.compose_one_pass(build("gemma3"), [prefix, suffix])
