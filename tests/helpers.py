"""Helpers the tests share (tiny random models built from configs, pairs of the shipped suite,
schema and figure checks, a scenario file in a new domain) and named float tolerances. Fixtures
live in ``conftest.py``."""

from __future__ import annotations

import os

import torch
import transformers as T

VOCAB = 96
WINDOW = 8  # sliding window smaller than the test prompts, so windows fill

# Named float tolerances. Rows of differently shaped batches go through different BLAS kernels
# (AVX2 vs AVX-512 builds, blocking by batch size), so the same fp32 computation in two batch
# compositions agrees to ~1e-6 on an O(1) log-prob, not bitwise.
BATCH_TOL = 1e-5
#: fp32 log-probs of a patched cache vs an independent reference forward.
LOGPROB_TOL = 1e-5

def tiny_config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if arch == "llama":
        return T.LlamaConfig(num_hidden_layers=3, **common)
    if arch == "qwen3":
        return T.Qwen3Config(num_hidden_layers=3, head_dim=16, **common)
    if arch == "mistral":
        return T.MistralConfig(num_hidden_layers=3, sliding_window=WINDOW, **common)
    if arch == "gemma2":
        return T.Gemma2Config(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, **common)
    if arch == "gemma3":
        return T.Gemma3TextConfig(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"] * 2, **common)
    raise ValueError(arch)


ARCHS = ["llama", "qwen3", "mistral", "gemma2", "gemma3"]


def build_tiny(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    model.requires_grad_(False)
    return model


def recall_pairs(bundle, ids, n_instances=2, per_instance=None, variant="direct"):
    """Token-aligned pairs of the named recall scenarios of the shipped suite (at most
    ``per_instance`` pairs of each instance, to keep embedded tests short)."""
    from omegaconf import OmegaConf

    from kvnotes.harness.pairs import prepare_pairs

    sc = OmegaConf.load(os.path.join(os.path.dirname(__file__), "..", "conf", "scenario", "default.yaml"))
    sc.families, sc.ids, sc.n_instances, sc.variant = ["recall"], ids, n_instances, variant
    ps = prepare_pairs(bundle.tokenizer, sc)
    if per_instance is not None:
        seen: dict = {}
        ps.pairs = [p for p in ps.pairs if seen.setdefault(p.spec.instance.id, []).append(p) or
                    len(seen[p.spec.instance.id]) <= per_instance]
    return ps


def check_figures(name: str, res: dict, tmp_path) -> None:
    """A probe's result, computed on a real model, matches its declared ``Result`` schema after a
    JSON round-trip (as in a record), and its figures render from it (figures come from records)."""
    import json

    import probes
    from kvnotes.plots import plot_record
    from kvnotes.records.store import to_jsonable
    from kvnotes.records.schema import check_result, result_schema

    record = json.loads(json.dumps(to_jsonable({"probe": name, "model": {"name": "smollm2-135m"},
                                                "scenario": {"name": "test"}, "result": res})))
    check_result(record["result"], result_schema(probes.module(name)))
    paths = plot_record(record, tmp_path)
    assert paths and all(p.is_file() and p.stat().st_size > 10_000 for p in paths)


def check_schema(name: str, res: dict) -> None:
    """A probe's result, computed on a real model, matches its declared ``Result`` schema after a
    JSON round-trip (as in a record; ``kvnotes.records.schema``)."""
    import json

    import probes
    from kvnotes.records.store import to_jsonable
    from kvnotes.records.schema import check_result, result_schema

    check_result(json.loads(json.dumps(to_jsonable(res))), result_schema(probes.module(name)))


def fruit_scenario(path):
    """Write a new scenario file (new domain, the shipped schema: favourite fruit, apple or grape) and
    return its path."""
    import yaml

    from tests.test_tokens import BASE

    path.write_text(yaml.safe_dump({**BASE, "domain": "favourite fruit", "id": "favourite_fruit",
                                    "field": {"slot": "colour", "values": ["apple", "grape"]},
                                    "candidates": {"apple": " apple", "grape": " grape"},
                                    "context": "Profile of {name}. Favourite fruit: {colour}.",
                                    "request": "What is the favourite fruit?",
                                    "variants": {"direct": {"decision": "Reply with the fruit only.",
                                                            "answer_prefix": "The favourite fruit is"}}}))
    return path
