"""Helpers the tests share (tiny random models built from configs, pairs of the shipped suite,
schema and figure checks, a scenario file in a new domain) and named float tolerances. Fixtures
live in ``conftest.py``."""

from __future__ import annotations

from dataclasses import dataclass

import os
from pathlib import Path

import torch
import transformers as T

#: The repository's top level (its docs, examples and configs).
ROOT = Path(__file__).resolve().parents[1]
#: Seconds after which a subprocess a test waits for has hung (not merely run slowly): no test waits on
#: wall-clock time for its result, so a loaded machine (load average 8) slows the suite but fails nothing.
HANG_S = 1800

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
    if arch in MLA_ARCHS:
        return _tiny_mla(arch)
    if arch in MROPE_ARCHS:
        return _tiny_mrope(arch)
    raise ValueError(arch)


ARCHS = ["llama", "qwen3", "mistral", "gemma2", "gemma3"]

#: MLA (DeepSeek) and M-RoPE (Qwen-VL) tiny models: not in ARCHS (the ``tiny`` fixture), since not every
#: circuit covers them; tests/ops/test_reposition_arch.py runs re-positioning, editing and composition on them.
MLA_ARCHS = ["deepseek_v2", "deepseek_v3", "deepseek_v3_half"]
MROPE_ARCHS = ["qwen2_5_vl", "qwen3_vl"]
#: Special tokens of the tiny VLMs (inside the vocabulary).
IMAGE_TOKEN, VISION_START, VISION_END = 90, 92, 93


def _tiny_mla(arch: str):
    mla = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
               qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
               first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=256)
    if arch == "deepseek_v2":          # q_lora_rank None: DeepSeek-V2-Lite's plain q_proj
        return T.DeepseekV2Config(q_lora_rank=None, **mla)
    # DeepSeek-V3: low-rank queries, grouped routing; rope_interleave True (default) and False
    return T.DeepseekV3Config(q_lora_rank=24, n_group=2, topk_group=1, rope_interleave=arch == "deepseek_v3", **mla)


def _tiny_mrope(arch: str):
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    tokens = dict(image_token_id=IMAGE_TOKEN, video_token_id=91, vision_start_token_id=VISION_START,
                  vision_end_token_id=VISION_END)
    if arch == "qwen2_5_vl":           # sectioned: pairs [0, 2) temporal, [2, 5) height, [5, 8) width
        return T.Qwen2_5_VLConfig(text_config=text, vision_config=dict(vision, fullatt_block_indexes=[0]), **tokens)
    # Qwen3-VL: the same sections interleaved (t, h, w, t, h, w, ...), q/k norms, deepstack
    return T.Qwen3VLConfig(text_config=dict(text, head_dim=16),
                           vision_config=dict(vision, deepstack_visual_indexes=[0], num_position_embeddings=16), **tokens)


def build_tiny(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    config = tiny_config(arch)
    if arch in MROPE_ARCHS:            # the wrapper with its vision tower and LM head
        model = T.AutoModelForImageTextToText.from_config(config).eval()
    else:
        model = T.AutoModelForCausalLM.from_config(config).eval()
    model.requires_grad_(False)
    return model


def default_probe() -> str:
    """The probe ``run.py`` runs when none is named: ``conf/config.yaml``'s defaults list."""
    from omegaconf import OmegaConf

    defaults = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "config.yaml"))["defaults"]
    return next(str(d["probe"]) for d in defaults if isinstance(d, dict) and "probe" in d)


def probe_yaml(name: str):
    """Probe ``name``'s config as run.py composes it, as a plain (non-struct) ``DictConfig`` a test
    may edit: its ``Config`` dataclass's defaults, then what ``conf/probe/<name>.yaml`` sets (the
    YAML holds only what differs; :func:`kvnotes.harness.registry.load_config`)."""
    from omegaconf import OmegaConf

    import kvnotes.probes

    return OmegaConf.create(OmegaConf.to_container(OmegaConf.structured(kvnotes.probes.load_config(name))))


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


def record_of(name: str, res: dict) -> dict:
    """The parts of a record of probe ``name`` that its table and figures read: the result, and the
    config naming the probe's module (its presentation, :mod:`kvnotes.records.presentation`)."""
    import kvnotes.probes

    return {"probe": name, "config": {"probe": {"_target_": f"{kvnotes.probes.module(name).__name__}.run"}},
            "model": {"name": "smollm2-135m"}, "scenario": {"name": "test"}, "result": res}


def check_figures(name: str, res: dict, tmp_path) -> None:
    """A probe's result, computed on a real model, matches its declared ``Result`` schema after a
    JSON round-trip (as in a record), and its figures render from it (figures come from records)."""
    import json

    import kvnotes.probes
    from kvnotes.plots import plot_record
    from kvnotes.records.store import to_jsonable
    from kvnotes.records.schema import check_result, result_schema

    record = json.loads(json.dumps(to_jsonable(record_of(name, res))))
    check_result(record["result"], result_schema(kvnotes.probes.module(name)))
    paths = plot_record(record, tmp_path)
    assert paths and all(p.is_file() and p.stat().st_size > 10_000 for p in paths)


def check_schema(name: str, res: dict) -> None:
    """A probe's result, computed on a real model, matches its declared ``Result`` schema after a
    JSON round-trip (as in a record; ``kvnotes.records.schema``)."""
    import json

    import kvnotes.probes
    from kvnotes.records.store import to_jsonable
    from kvnotes.records.schema import check_result, result_schema

    check_result(json.loads(json.dumps(to_jsonable(res))), result_schema(kvnotes.probes.module(name)))


def fruit_scenario(path):
    """Write a new scenario file (new domain, the shipped schema: favourite fruit, apple or grape) and
    return its path."""
    import yaml

    from tests.harness.test_tokens import BASE

    path.write_text(yaml.safe_dump({**BASE, "domain": "favourite fruit", "id": "favourite_fruit",
                                    "field": {"slot": "colour", "values": ["apple", "grape"]},
                                    "candidates": {"apple": " apple", "grape": " grape"},
                                    "context": "Profile of {name}. Favourite fruit: {colour}.",
                                    "request": "What is the favourite fruit?",
                                    "variants": {"direct": {"decision": "Reply with the fruit only.",
                                                            "answer_prefix": "The favourite fruit is"}}}))
    return path


def cot_tiny_ctx(model, monkeypatch, *modules):
    """A probe context for a probe's chain-of-thought functions on a tiny model: no tokenizer, so the
    end tokens are patched to none in :mod:`kvnotes.harness.kit` and in each of ``modules`` (the
    probe modules that import ``stop_tokens``); the marker test is the test's to patch
    (``kit.cot_marker``)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from kvnotes.harness import kit

    for m in (kit, *modules):
        if hasattr(m, "stop_tokens"):
            monkeypatch.setattr(m, "stop_tokens", lambda tok: [])
    return SimpleNamespace(bundle=SimpleNamespace(model=model, tokenizer=None), thinking=False,
                           timer=lambda name: nullcontext())


def job_record(bundle, out, *overrides: str) -> dict:
    """The record ``python run.py <overrides>`` writes, made by the same job path
    (:func:`kvnotes.harness.jobs.run_job`: typed config, variant check, pairs, probe, record checks)
    in this process on an already loaded model (``bundle``; the command line around it is tested in
    tests/cli/test_cli.py), so an end-to-end test does not spend seconds starting a process and loading
    the model again."""
    import json
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from kvnotes.harness.jobs import run_job

    with initialize_config_dir(str(Path(__file__).resolve().parent.parent / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return json.loads(run_job(cfg, Path(out), {"launcher": "tests"}, log=lambda _: None, bundle=bundle).read_text())



@dataclass
class Ran:
    """What a command did: its exit status and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def run_kvnotes(monkeypatch, capsys, *args) -> Ran:
    """Run ``kvnotes ARGS`` in this process (the dispatcher, as the console script calls it): no
    interpreter start, torch import or model load beyond the session's first. A command's
    ``--threads`` does not outlive it: torch's thread count is restored when torch was loaded."""
    import sys

    from kvnotes.cli import main

    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    monkeypatch.setattr(sys, "argv", ["kvnotes", *map(str, args)])
    code = 0
    try:
        main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        if threads is not None:
            torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return Ran(code, out, err)
