"""The intervention engine: plain forwards are untouched, interventions land where they say, and
the nnsight and TransformerLens backends give the same numbers."""

from __future__ import annotations

import pytest
import torch

from kvnotes.kv.engine import KINDS, Intervention, LensEngine, NNsightEngine
from kvnotes.kv.masks import site_masks
from kvnotes.kv.sites import Site, kv_site
from kvnotes.kv import cache as kvcache
from tests.helpers import ARCHS, VOCAB, build_tiny

TOL = 1e-5
T = 14
START = 9


def _ids(seed=1):
    return torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=ARCHS)
def nn_engine(request):
    return NNsightEngine(build_tiny(request.param))


def test_no_intervention_equals_plain_forward(nn_engine):
    """Adapter-free check: the engine's logits and the decoder output equal a plain HF forward
    (hidden_states from output_hidden_states, not from adapter paths), with and without a cache."""
    model = nn_engine.model
    ids = _ids()
    with torch.no_grad():
        ref = model(ids[None], output_hidden_states=True)
    lp_ref = torch.log_softmax(ref.logits.float(), -1)
    L = model.config.num_hidden_layers
    out = nn_engine.run(ids, capture=[Site("resid_post", l) for l in range(L - 1)] + [Site("resid_pre", 0)], n_keep=None)
    assert (out.logprobs - lp_ref).abs().max() < TOL
    for l in range(L - 1):   # HF hidden_states[l + 1] is layer l's output (the last one is normed)
        assert (out.acts[Site("resid_post", l)] - ref.hidden_states[l + 1]).abs().max() < TOL
    assert (out.acts[Site("resid_pre", 0)] - ref.hidden_states[0]).abs().max() < TOL
    prefix = kvcache.prefill(model, ids[:START])
    resumed = nn_engine.run(ids[START:], cache=prefix, start=START, n_keep=None)
    assert (resumed.logprobs - lp_ref[:, START:]).abs().max() < 1e-4
    assert kvcache.seq_length(prefix) == START          # the prefix cache is not extended


def test_n_keep_unembeds_only_the_kept_positions(nn_engine):
    """``n_keep`` positions go through the unembedding (``logits_to_keep``), with the logits of
    the full forward's last positions, an intervention applied or not."""
    model = nn_engine.model
    ids = _ids()
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, o: rows.append(a[0].shape[:-1].numel()))
    try:
        full = nn_engine.run(ids, n_keep=None).logprobs
        last = nn_engine.run(ids, n_keep=2).logprobs
        iv = [Intervention(Site("resid_post", 0, [3]), torch.ones(1, 1, model.config.hidden_size), mode="add")]
        moved_full = nn_engine.run(ids, iv, n_keep=None).logprobs
        moved_last = nn_engine.run(ids, iv, n_keep=1).logprobs
    finally:
        hook.remove()
    assert rows == [T, 2, T, 1]
    assert last.shape == (1, 2, VOCAB) and (last - full[:, -2:]).abs().max() < TOL
    assert (moved_last - moved_full[:, -1:]).abs().max() < TOL
    assert (moved_last - full[:, -1:]).abs().max() > 1e-3       # the intervention reached the kept row


def test_interventions_land_and_identity_patch_is_exact(nn_engine):
    ids = _ids()
    H = nn_engine.adapter.n_heads
    hd = nn_engine.adapter.head_dim
    base = nn_engine.run(ids, capture=[Site(k, 1) for k in KINDS], n_keep=None)
    # writing a site's own activation back changes nothing
    same = [Intervention(Site(k, 1, range(T)), base.acts[Site(k, 1)]) for k in KINDS]
    assert (nn_engine.run(ids, same, n_keep=None).logprobs - base.logprobs).abs().max() < TOL
    # per-variant head masks: variant v patches head v only at positions 3, 5
    val = torch.randn(H, 2, H, hd, generator=torch.Generator().manual_seed(0))
    where = torch.eye(H, dtype=torch.bool)[:, None, :].expand(H, 2, H)
    out = nn_engine.run(ids, [Intervention(Site("hook_z", 1, [3, 5]), val, where=where)], capture=[Site("hook_z", 1)],
                        n_keep=None)
    got = out.acts[Site("hook_z", 1)]
    for v in range(H):
        assert torch.allclose(got[v, [3, 5], v], val[v, :, v])
        others = [h for h in range(H) if h != v]
        assert torch.allclose(got[v][:, others], base.acts[Site("hook_z", 1)][0][:, others])
    # an add on the residual moves the logits of later positions only
    delta = torch.ones(1, 1, nn_engine.adapter.hidden_size)
    moved = nn_engine.run(ids, [Intervention(Site("resid_post", 0, [6]), delta, mode="add")], n_keep=None).logprobs
    assert (moved[0, :6] - base.logprobs[0, :6]).abs().max() < TOL
    assert (moved[0, 6:] - base.logprobs[0, 6:]).abs().max() > 1e-3


def test_bad_positions_raise(nn_engine):
    ids = _ids()
    iv = Intervention(Site("resid_post", 0, [T + 3]), torch.zeros(1, 1, nn_engine.adapter.hidden_size))
    with pytest.raises(IndexError):
        nn_engine.run(ids, [iv])
    with pytest.raises(ValueError):
        nn_engine.run(ids, start=2)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_backends_agree(arch):
    """nnsight and TransformerLens 4 give the same activations and log-probs (to 1e-5) for every
    site kind, with and without interventions, with a resumed cache and batched variants."""
    model = build_tiny(arch)
    try:
        lens = LensEngine(model)
    except Exception as exc:  # the bridge has no adapter for this architecture
        pytest.skip(f"TransformerBridge cannot wrap tiny {arch}: {type(exc).__name__}: {exc}")
    nn = NNsightEngine(model)
    ids = _ids(2)
    hd, D = nn.adapter.head_dim, nn.adapter.hidden_size
    L = nn.adapter.n_layers
    sites = [Site(k, l) for l in range(L) for k in KINDS]
    a = nn.run(ids, capture=sites, n_keep=None)
    b = lens.run(ids, capture=sites, n_keep=None)
    assert (a.logprobs - b.logprobs).abs().max() < TOL
    for s in sites:
        assert (a.acts[s] - b.acts[s]).abs().max() < TOL, s
    g = torch.Generator().manual_seed(3)
    prefix = kvcache.prefill(model, ids[:START])
    ivs = [Intervention(Site("hook_z", 0, [START, START + 2], heads=[1, 2]), torch.randn(3, 2, 2, hd, generator=g),
                        where=torch.rand(3, 2, 2, generator=g) > 0.5),
           Intervention(Site("attn_out", 1, [START + 1]), torch.randn(3, 1, D, generator=g), mode="add"),
           Intervention(Site("mlp_out", 1, [START + 3]), torch.randn(1, 1, D, generator=g)),
           Intervention(Site("resid_post", L - 2, [START + 4]), torch.randn(3, 1, D, generator=g), mode="add")]
    cap = [Site("hook_z", 1), Site("resid_post", L - 1)]
    a = nn.run(ids[START:], ivs, cap, cache=prefix, start=START, n_keep=None)
    b = lens.run(ids[START:], ivs, cap, cache=prefix, start=START, n_keep=None)
    assert a.logprobs.shape == (3, T - START, VOCAB)
    assert (a.logprobs - b.logprobs).abs().max() < TOL
    for s in cap:
        assert (a.acts[s] - b.acts[s]).abs().max() < TOL
    plain = nn.run(ids[START:], cache=prefix, start=START, n_keep=None)
    assert (a.logprobs - plain.logprobs).abs().max() > 1e-3       # the interventions did something


def test_kv_sites_are_not_engine_sites(nn_engine):
    """K/V entries are sites of the attention backend (kind ``"kv"``, :func:`kvnotes.kv.sites.kv_site`), not of the
    engine: one site vocabulary, one executor per kind of site; each refuses the other's in one line."""
    for kind in ("hook_rot_k", "hook_v"):
        with pytest.raises(ValueError, match="site kind must be one of"):
            Site(kind, 0)  # type: ignore[arg-type]
    ids = torch.arange(3, 9)
    with pytest.raises(ValueError, match="not an engine site"):
        nn_engine.run(ids, capture=[kv_site([1], [0])])
    with pytest.raises(ValueError, match="not an engine site"):
        Intervention(kv_site([1], [0]), torch.zeros(1, 1, 1))
    with pytest.raises(ValueError, match="only K/V sites are masks"):
        site_masks(2, 6, [Site("resid_post", 0, [1])])
    with pytest.raises(ValueError, match="a capture names"):
        nn_engine.run(ids, capture=[Site("resid_post", 0, [1])])
    with pytest.raises(ValueError, match="names its positions"):
        Intervention(Site("resid_post", 0), torch.zeros(1, 1, 1))


def test_a_site_is_its_kind_layers_positions_and_heads():
    """Indices are kept as tuples (an int is one; numpy and 0-d tensor ints too), so sites compare and
    hash by value: a capture's key is the site the caller builds again."""
    import numpy as np

    assert Site("resid_post", np.int64(2)) == Site("resid_post", torch.tensor(2)) == Site("resid_post", [2])
    assert Site("hook_z", 1, range(3, 5), heads=[0]).at == Site("hook_z", 1)
    assert kv_site(range(2, 4), None, [1]) == Site("kv", None, (2, 3), (1,))
    with pytest.raises(ValueError, match="exactly one layer"):
        Site("attn_out", [0, 1])
    with pytest.raises(ValueError, match="heads= only applies"):
        Site("mlp_out", 0, [1], heads=[0])
