"""Prepacked oneDNN linear layers (kvnotes.models.cpu_linear): same numbers as PyTorch's default
kernel within fp32 summation-order tolerance, on every tiny architecture, through the KV cache and
the intervention engine; never a stale packed weight."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from kvnotes.errors import KvnotesError
from kvnotes.kv import cache as kvcache
from kvnotes.kv.engine import make_engine
from kvnotes.kv.sites import Site
from kvnotes.models import cpu_linear
from tests.helpers import ARCHS, MLA_ARCHS, build_tiny

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear ops")

#: fp32 logits of a packed model against the unpacked one (summation order only; nats).
LOGIT_TOL = 1e-4


def _ids(model, n: int = 12) -> torch.Tensor:
    return torch.randint(3, model.config.get_text_config().vocab_size, (1, n), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ARCHS + MLA_ARCHS[:1])
def test_packed_model_equals_default_kernel(arch):
    model = build_tiny(arch)
    ids = _ids(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        cache = kvcache.prefill(model, ids[0, :-1])
        ref_step = kvcache.continuation_logprobs(model, cache, ids[0, -1:], ids.shape[1] - 1)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert cpu_linear.pack_linears(model) == n_linear == cpu_linear.packed_layers(model) > 0
    with torch.no_grad():
        got = model(input_ids=ids).logits
        cache = kvcache.prefill(model, ids[0, :-1])
        step = kvcache.continuation_logprobs(model, cache, ids[0, -1:], ids.shape[1] - 1)
    assert (got - ref).abs().max() < LOGIT_TOL
    assert (step - ref_step).abs().max() < LOGIT_TOL
    assert cpu_linear.pack_linears(model) == 0          # already packed: left as they are


def test_packed_weights_are_used_and_never_stale():
    model = build_tiny("llama")
    cpu_linear.pack_linears(model)
    ids = _ids(model)
    head = model.get_output_embeddings()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        packed = head._kvnotes_packed.tensor
        head._kvnotes_packed.tensor = cpu_linear.pack_weight(torch.zeros_like(head.weight))
        assert model(input_ids=ids).logits.abs().max() == 0           # the packed copy is what runs
        head._kvnotes_packed.tensor = packed
        copied = copy.deepcopy(model)                                 # runs, on the default kernel
        assert cpu_linear.packed_layers(copied) == 0
        assert (copied(input_ids=ids).logits - before).abs().max() < LOGIT_TOL
        assert cpu_linear.pack_linears(copied) == cpu_linear.packed_layers(model)   # and can be packed again
        assert (copied(input_ids=ids).logits - before).abs().max() < LOGIT_TOL
        head.weight.mul_(2.0)                                         # changed in place after packing
        after = model(input_ids=ids).logits
    assert (after - 2 * before).abs().max() < 2 * LOGIT_TOL            # the dense weight, not the stale copy


def test_engine_backends_on_a_packed_model():
    model = build_tiny("qwen3")
    ids = _ids(model)[0]
    ref = make_engine(build_tiny("qwen3"), "nnsight").run(ids, capture=[Site("hook_z", 1)])
    cpu_linear.pack_linears(model)                    # before any wrapper, as load_model does
    out = make_engine(model, "nnsight").run(ids, capture=[Site("hook_z", 1)])
    assert (out.logprobs - ref.logprobs).abs().max() < LOGIT_TOL
    assert (out.acts[Site("hook_z", 1)] - ref.acts[Site("hook_z", 1)]).abs().max() < LOGIT_TOL


def test_left_alone():
    model = build_tiny("llama").to(torch.bfloat16)
    assert cpu_linear.pack_linears(model) == 0                          # not fp32
    model = build_tiny("llama")
    assert cpu_linear.pack_linears(model, max_bytes=1024) == 0           # too large to copy
    head = model.get_output_embeddings()
    head.forward = head.forward                                         # wrapped by someone else
    assert cpu_linear.pack_linears(model) == sum(type(m) is torch.nn.Linear for m in model.modules()) - 1
    assert "_kvnotes_packed" not in head.__dict__


def test_load_model_option():
    """load_model packs by default and records it; ``torch`` keeps PyTorch's kernel; a bad value is one line."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from kvnotes.models.loading import load_model

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["model=qwen3-8b", "model.random_init.enabled=true"]).model
    packed = load_model(cfg, "cpu")
    n = sum(type(m) is torch.nn.Linear for m in packed.model.modules())
    assert cpu_linear.packed_layers(packed.model) == n and packed.info["cpu_linear"] == f"onednn ({n} layers prepacked)"
    plain = load_model(OmegaConf.merge(cfg, {"cpu_linear": "torch"}), "cpu")
    assert cpu_linear.packed_layers(plain.model) == 0 and plain.info["cpu_linear"] == "torch"
    ids = torch.arange(5, 17)[None]
    with torch.no_grad():
        assert (packed.model(input_ids=ids).logits - plain.model(input_ids=ids).logits).abs().max() < LOGIT_TOL
    with pytest.raises(KvnotesError, match="unknown model.cpu_linear 'mkl'"):
        load_model(OmegaConf.merge(cfg, {"cpu_linear": "mkl"}), "cpu")
