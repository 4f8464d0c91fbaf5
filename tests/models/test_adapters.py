"""Architecture adapters (declared in kvnotes/models/adapters.yaml) on tiny random models."""

from __future__ import annotations

import pytest
import torch

from kvnotes.models.adapters import Adapter, adapter_table
from kvnotes.errors import KvnotesError

EXPECTED = {  # model_type -> (sliding layer count, has post norms, has qk norm)
    "llama": (0, False, False),
    "qwen3": (0, False, True),
    "mistral": (3, False, False),
    "gemma2": (2, True, False),
    "gemma3_text": (2, True, True),
}


def test_adapter_geometry_and_paths(tiny):
    ad = Adapter.for_model(tiny)
    cfg = tiny.config
    n_sliding, post_norms, qk_norm = EXPECTED[cfg.model_type]
    assert ad.n_layers == cfg.num_hidden_layers == len(ad.layers(tiny))
    assert (ad.n_heads, ad.n_kv_heads, ad.head_dim) == (4, 2, 16)
    assert sum(t == "sliding_attention" for t in ad.layer_types) == n_sliding
    assert ad.has_post_norms == post_norms
    for layer in range(ad.n_layers):
        o_proj = ad.module(tiny, "o_proj", layer)
        assert isinstance(o_proj, torch.nn.Linear) and o_proj.in_features == ad.n_heads * ad.head_dim
        k_proj = ad.module(tiny, "k_proj", layer)
        assert k_proj.out_features == ad.n_kv_heads * ad.head_dim
        assert ad.module(tiny, "attn", layer).layer_idx == layer
        for piece in ("mlp", "pre_attn_norm", "pre_mlp_norm"):
            assert isinstance(ad.module(tiny, piece, layer), torch.nn.Module)
        assert (ad.module(tiny, "post_attn_norm", layer) is not None) == post_norms
        assert (ad.module(tiny, "q_norm", layer) is not None) == qk_norm
    assert ad.module(tiny, "unembed").out_features == tiny.config.vocab_size
    assert ad.module(tiny, "rotary") is not None


def test_gemma3_local_and_global_rope_theta():
    from tests.helpers import build_tiny

    ad = Adapter.for_model(build_tiny("gemma3"))
    thetas = dict(zip(ad.layer_types, ad.rope_theta))
    assert thetas["sliding_attention"] != thetas["full_attention"]


def test_every_adapter_declares_every_piece():
    table = adapter_table()
    assert {"llama", "qwen3", "mistral", "gemma2", "gemma3", "gemma3_text"} <= set(table)


def test_unknown_architecture_is_a_clear_error(tiny):
    class Fake(torch.nn.Module):
        config = type("C", (), {"model_type": "nonesuch"})()

    with pytest.raises(KvnotesError, match="no architecture adapter for model_type 'nonesuch'"):
        Adapter.for_model(Fake())


@pytest.mark.parametrize("name,kind", [("Qwen3NextConfig", "linear_attention"), ("JambaConfig", "linear_attention"),
                                       ("MambaConfig", "linear_attention"), ("FalconH1Config", "hybrid"),
                                       ("RecurrentGemmaConfig", "linear_attention"), ("BambaConfig", "linear_attention")])
def test_recurrent_layers_are_refused_in_one_line(name, kind):
    """Models whose layers keep a recurrent state are refused before loading, naming the layer type."""
    import transformers as T

    from kvnotes.errors import KvnotesError
    from kvnotes.models.adapters import Adapter

    config = getattr(T, name)()
    with pytest.raises(KvnotesError) as err:
        Adapter.check_config(config)
    msg = str(err.value)
    assert f"'{kind}' layers" in msg and config.model_type in msg and "\n" not in msg


def test_per_token_models_pass_the_recurrence_check():
    import transformers as T

    from kvnotes.models.adapters import check_per_token

    for config in (T.LlamaConfig(), T.Gemma3TextConfig(), T.Qwen3MoeConfig(), T.Qwen2_5_VLConfig()):
        check_per_token(config)
