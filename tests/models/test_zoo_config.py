"""Architecture as data: every ``conf/model`` entry's ``architecture`` block builds a transformers config
of the right class; shrinking keeps every structural property; the embedded models' own configs
match their blocks."""

from __future__ import annotations

import pytest
import torch

from kvnotes.models import zoo
from kvnotes.models.adapters import Adapter


@pytest.mark.parametrize("name", zoo.zoo_names())
def test_every_block_builds_a_config_of_its_class(name):
    import transformers as T

    config = zoo.architecture_config(zoo.zoo_config(name))
    cls = getattr(T, config.architectures[0])
    assert isinstance(config, cls.config_class)
    Adapter.check_config(config)                                  # every zoo architecture has an adapter
    text = config.get_text_config(decoder=True)
    assert text.num_attention_heads % text.num_key_value_heads == 0


def test_the_lane_names_every_zoo_entry_once():
    groups = zoo.lane_groups()
    named = sorted(n for members in groups.values() for n in members)
    assert named == zoo.zoo_names()
    assert all(rep in members for rep, members in groups.items())
    # structurally different shapes stay apart
    def group(n):
        return next(rep for rep, members in groups.items() if n in members)
    assert group("gemma-3-270m") != group("gemma-3-4b")           # text model vs multimodal wrapper
    assert group("qwen3-8b") != group("qwen3-30b-a3b")            # dense vs MoE
    assert group("llama-3.1-8b") != group("smollm2-135m")         # llama3 rope scaling vs default


@pytest.mark.parametrize("name", ["gemma-3-270m", "gemma-3-4b", "gemma-2-9b", "qwen3-30b-a3b", "llama-3.1-70b",
                                  "smollm2-1.7b", "deepseek-v2-lite", "qwen2.5-vl-3b", "qwen3-vl-2b"])
def test_shrinking_keeps_the_structure(name):
    cfg = zoo.zoo_config(name)
    full = zoo.architecture_config(cfg)
    small = zoo.shrink_config(full, zoo.Shrink(vocab_size=512))
    assert zoo.signature(small) == zoo.signature(full)
    ft, st = full.get_text_config(decoder=True), small.get_text_config(decoder=True)
    assert (st.num_attention_heads, st.num_key_value_heads) == (ft.num_attention_heads, ft.num_key_value_heads)
    assert st.head_dim == (getattr(ft, "head_dim", None) or ft.hidden_size // ft.num_attention_heads)
    assert st.hidden_size == (64 if getattr(ft, "head_dim", None) else ft.hidden_size) and st.vocab_size == 512
    if getattr(ft, "sliding_window", None):
        assert st.sliding_window == 16 and set(st.layer_types) == set(ft.layer_types)
    model = zoo.random_model(cfg, zoo.Shrink(vocab_size=512))
    assert type(model).__name__ == full.architectures[0]
    a = Adapter.for_model(model)
    assert (a.n_heads, a.n_kv_heads) == (ft.num_attention_heads, ft.num_key_value_heads)
    assert a.layers(model) is not None and len(a.layers(model)) == st.num_hidden_layers
    ids = torch.randint(0, 512, (1, 24))
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_full_size_shape_builds_on_meta():
    model = zoo.random_model(zoo.zoo_config("qwen3-8b"), shrink=False, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert 8.0e9 < n < 8.4e9                                      # Qwen3-8B: 8.19B parameters


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_embedded_models_match_their_blocks(name):
    """The transcribed block equals the config of the real embedded checkpoint (keys the block sets)."""
    from transformers import AutoConfig

    from kvnotes.models.loading import materialise_embedded

    cfg = zoo.zoo_config(name)
    path, _ = materialise_embedded(cfg.embedded)
    real = AutoConfig.from_pretrained(path)
    ours = zoo.architecture_config(cfg)
    assert type(real) is type(ours)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "sliding_window", "layer_types",
                "rope_parameters", "tie_word_embeddings", "query_pre_attn_scalar"):
        if hasattr(ours, key) and getattr(ours, key) is not None:
            assert getattr(real, key) == getattr(ours, key), key
