"""The user-memory experiments (E2 transplant, E3 edits, E4 granularity; issue #21 part 2): the memory
suite schema, the invariants (S = 1 is the one-chunk transplant; recompiling the chunk with a seam
that covers it is the full prefill), each probe's record fields on a tiny random Llama with the
embedded SmolLM2 tokenizer, and one end-to-end run on the embedded model."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers as T
import yaml

import kvnotes.probes
from kvnotes.harness import memory as mem
from kvnotes.records.store import Timer
from kvnotes.scenarios.errors import ScenarioError
from kvnotes.scenarios.memory import load_memory
from tests.helpers import check_figures, check_schema, tiny_config

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "scenarios" / "memory" / "personas.yaml"
#: fp32 decision log-probs of two compositions of the same blocks (same kernels, batch 1 each).
SAME_PATH_TOL = 1e-6
#: fp32 log-probs of a composition whose seam recomputes every chunk token vs a plain prefill of the
#: same tokens (different forward shapes: BLAS blocking differs).
FULL_SEAM_TOL = 1e-4
#: KL(full || arm) in nats of two computations of the same distribution over the whole vocabulary
#: (fp32; 5.8e-8 seen on an Intel Xeon where an AMD EPYC gave under 1e-8).
KL_TOL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def threads():
    """Honour ``OMP_NUM_THREADS`` (conftest sets 2 torch threads; on a loaded 2-core machine two
    threads per process make these small forwards ~100x slower)."""
    old = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tok():
    from kvnotes.models.loading import load_tokenizer
    from kvnotes.models.zoo import zoo_config

    return load_tokenizer(zoo_config("smollm2-135m"))


@pytest.fixture(scope="module")
def llama(tok):
    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg.vocab_size, cfg.max_position_embeddings = len(tok), 4096
    return T.AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def suite():
    return load_memory(SUITE, ["maria", "tom"])


def prompt_of(tok, suite, persona="maria", target=128, **kw):
    return mem.build_prompt(tok, suite, next(p for p in suite.personas if p.id == persona), target, **kw)


# ------------------------------------------------------------------------------------------- schema

def test_shipped_suite_loads_and_renders_to_length(tok, suite):
    full = load_memory(SUITE)
    assert len(full.personas) == 4 and all(p.edits for p in full.personas)
    p = prompt_of(tok, suite, target=300)
    assert p.memory.shape[0] >= 300 and p.memory.shape[0] < 300 + 40          # one filler line over at most
    assert int(p.prefix[0]) == tok.bos_token_id and set(p.facts) - {None} == {f.id for f in suite.personas[0].facts}
    longer = prompt_of(tok, suite, target=600)
    assert longer.n_filler > p.n_filler


def test_malformed_suite_is_one_line(tmp_path):
    raw = yaml.safe_load(SUITE.read_text())
    raw["personas"][0]["queries"][0]["answer"] = "Klingon"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ScenarioError) as exc:
        load_memory(bad)
    msg = str(exc.value)
    assert "\n" not in msg and "bad.yaml" in msg and "personas[0].queries[0].answer" in msg and "Klingon" in msg
    raw = yaml.safe_load(SUITE.read_text())
    del raw["filler"]
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ScenarioError, match=r"bad.yaml: key 'filler': missing$"):
        load_memory(bad)
    with pytest.raises(ScenarioError, match="no persona 'nobody'"):
        load_memory(SUITE, ["nobody"])


def test_partition_covers_the_lines_in_equal_blocks():
    from kvnotes.probes.memory_granularity import cross_variants, partition

    offsets = list(range(0, 101, 5))                 # 20 lines of 5 tokens
    for S in (1, 2, 4, 8, 16, 20):
        blocks = partition(offsets, S)
        assert len(blocks) == S and blocks[0][0] == 0 and blocks[-1][1] == 20
        assert all(a < b and b == c for (a, b), (c, _) in zip(blocks, blocks[1:]))
    v = cross_variants(partition(offsets, 4), 9, 10)
    assert any(i <= 9 and 10 < j for i, j in v["together"]) and any(j == 10 for _, j in v["split"])
    assert len(v["together"]) == len(v["split"]) == 4


# ------------------------------------------------------------------------------------------- invariants

def test_one_block_equals_the_one_chunk_transplant(llama, tok, suite):
    """S = 1 (E4) composes exactly E2's one precompiled chunk."""
    from kvnotes.ops import compose as kvcompose
    from kvnotes.probes.memory_granularity import Blocks, partition

    p = prompt_of(tok, suite)
    pos = p.start + p.memory.shape[0]
    sink = mem.bos_sink(tok, p)
    blocks = Blocks(llama, p, sink)
    one, _ = blocks.compose(partition(p.offsets(), 1), 0)
    chunk = kvcompose.precompile(llama, p.memory, sink)
    ref, _ = kvcompose.compose(llama, [p.prefix, chunk], True, 0, all_slots=True)
    for q in p.queries.values():
        a, b = mem.read(llama, one, pos, q.suffix), mem.read(llama, ref, pos, q.suffix)
        assert (a - b).abs().max() < SAME_PATH_TOL


def test_recompile_chunk_with_a_covering_seam_equals_the_full_prefill(llama, tok, suite):
    from kvnotes.probes.memory_edits import edit_session

    persona = suite.personas[0]
    p = prompt_of(tok, suite)
    row = edit_session(llama, tok, suite, persona, p, persona.edits[0], [4], seam=10 ** 6)
    rc = row["arms"]["recompile_chunk"]
    assert rc["same_tokens"] and rc["top1_agree"] and rc["kl"] < KL_TOL
    # and directly: the seam forward recomputes the whole memory against the prefix
    from kvnotes.ops import compose as kvcompose

    chunk = kvcompose.precompile(llama, p.memory, mem.bos_sink(tok, p))
    cache, _ = kvcompose.compose(llama, [p.prefix, chunk], True, len(chunk), all_slots=True)
    full, _ = mem.prefill(llama, p.base)
    pos = p.start + p.memory.shape[0]
    for q in list(p.queries.values())[:2]:
        assert (mem.read(llama, cache, pos, q.suffix) - mem.read(llama, full, pos, q.suffix)).abs().max() < FULL_SEAM_TOL


# ------------------------------------------------------------------------------------------- records

def fake_ctx(name: str, bundle, **over):
    cfg = kvnotes.probes.load_config(name, {"progress": False, "n_boot": 50, "personas": ["maria", "tom"], **over})
    return SimpleNamespace(cfg=cfg, bundle=bundle, timer=Timer(), seed=0, template_kwargs={})


def check_record_fields(name: str, res: dict, arms: list[str], tmp_path=None) -> None:
    if tmp_path is None:
        check_schema(name, res)
    else:
        tmp_path.mkdir(parents=True, exist_ok=True)
        check_figures(name, res, tmp_path)
    s = res["settings"]
    assert s["margin_accuracy"] > 0 and s["margin_kl"] > 0 and s["alpha"] == 0.05
    for cell, t in res["tests"].items():
        assert set(t) == {"mcnemar", "tost_accuracy", "tost_kl"}, cell
        assert {"margin", "p", "q", "equivalent", "ci", "n_clusters"} <= set(t["tost_kl"]), cell
        assert {"b", "c", "p", "q"} <= set(t["mcnemar"]), cell
    assert set(res["bh"]) == {"mcnemar", "tost_accuracy", "tost_kl"}
    for r in res["rows"]:
        assert set(r["arms"]) >= set(arms) and all(a["kl"] >= 0 for a in r["arms"].values())


def test_probe_records_on_a_tiny_model(llama, tok):
    bundle = SimpleNamespace(model=llama, tokenizer=tok)
    res = kvnotes.probes.get("memory_transplant")(fake_ctx("memory_transplant", bundle, lengths=[96, 160]))
    check_record_fields("memory_transplant", res, res["arm_names"])
    assert len(res["rows"]) == 2 * 2 * 7 and set(res["aggregates"]) == {"96", "160"}
    res = kvnotes.probes.get("memory_edits")(fake_ctx("memory_edits", bundle, lengths=[96]))
    check_record_fields("memory_edits", res, res["arm_names"])
    assert res["checks"]["recompile_same_tokens"] == res["checks"]["n_rows"] == 2
    assert all(r["arms"]["stale"]["tokens"] == 0 for r in res["rows"])
    res = kvnotes.probes.get("memory_granularity")(fake_ctx("memory_granularity", bundle, lengths=[128], blocks=[1, 2, 4]))
    check_record_fields("memory_granularity", res, ["S=1", "S=2", "S=4"])
    assert res["edit_rows"] and res["cross_rows"]
    assert all(r["arms"]["S=4"]["edit_tokens"] < r["full_tokens"] for r in res["edit_rows"])


def test_smollm2_end_to_end(smol, tmp_path):
    """The three probes on the embedded model at a short memory (figures rendered from the result)."""
    names = {"memory_transplant": {"seams": [0]}, "memory_edits": {"ks": [4]}, "memory_granularity": {"blocks": [1, 2]}}
    for name, over in names.items():
        res = kvnotes.probes.get(name)(fake_ctx(name, smol, lengths=[96], **over))
        arms = res.get("arm_names") or [f"S={s}" for s in over["blocks"]]
        check_record_fields(name, res, arms, tmp_path / name)
    assert sum(r["owned"] for r in res["rows"]) > 0          # E4's rows: every query of both personas
