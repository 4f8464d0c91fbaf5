"""The edit + compose agent loop (probes/agent.py) and multi-turn rendering on the embedded model."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers as T
from omegaconf import OmegaConf

from kvnotes import CONF_DIR
from kvnotes.harness import reader as reader_mod
from kvnotes.harness.reader import PromptReader
from kvnotes.kv.generate import token_marker
from kvnotes.probes import ProbeContext
from kvnotes.probes import agent as agent_mod
from kvnotes.probes.agent import aggregate, run_trajectory, trajectory_values
from tests.helpers import ARCHS, check_figures, check_schema, job_record, tiny_config, probe_yaml

#: fp32 on CPU: with whole chunks recomputed (seam >= chunk length) the agent's composed-then-
#: appended cache is the transcript's full prefill computed in several forwards; measured KL ~1e-9.
EXACT_KL = 1e-5


def scenario_cfg(families=("recall",), ids=("home_city",), transcript=None):
    sc = OmegaConf.load(os.path.join(CONF_DIR, "scenario", "default.yaml"))
    sc.families, sc.ids, sc.n_instances = list(families), list(ids), 1
    if transcript is not None:
        sc.transcript = {"turns": transcript}
    return sc


def run_agent(smol, seam: int, turns: int = 3, **scenario):
    from kvnotes.harness.pairs import prepare_pairs
    from kvnotes.probes.agent import run

    cfg = probe_yaml("agent")
    cfg.progress, cfg.n_boot, cfg.turns, cfg.seam = False, 200, turns, seam
    sc = scenario_cfg(**scenario)
    ctx = ProbeContext(bundle=smol, pairs=prepare_pairs(smol.tokenizer, sc), cfg=cfg, seed=0, scenario_cfg=sc)
    return run(ctx)


def test_conversation_rendering_extends_the_single_turn_prompt(smol):
    from kvnotes.harness.tokens import build_conversation, build_prompt, render_conversation, render_text

    tok = smol.tokenizer
    one, _ = render_text(tok, "Where is it?", "It is in", True, "Be brief.")
    assert render_conversation(tok, ["Where is it?"], [], "It is in", True, "Be brief.")[0] == one
    two, start = render_conversation(tok, ["Where is it?", "Update: moved."], [" Paris"], "It is in", True)
    assert "It is in Paris" in two and two.endswith("It is in") and two.index("Update: moved.") > start
    plain, _ = render_conversation(tok, ["A?", "B?"], [" x"], "Ans:", False)
    assert plain == "A?\nAns: x\nB?\nAns:"
    with pytest.raises(ValueError):
        render_conversation(tok, ["A?", "B?"], [], "Ans:", False)
    p1 = build_prompt(tok, "The city is Lyon.", (12, 16), "It is in")
    p2 = build_conversation(tok, ["The city is Lyon.", "Update."], [" Lyon"], (12, 16), "It is in")
    assert p2.ids[:len(p1.ids)].tolist() == p1.ids.tolist()            # ChatML: a later turn only appends
    assert tok.decode(p2.ids[p2.field[0]:p2.field[1]]).strip() == "Lyon"


def test_trajectory_values_change_every_turn_and_are_seeded(smol):
    from kvnotes.probes.agent import trajectory_values
    from kvnotes.scenarios.instances import draw_instances
    from kvnotes.scenarios.schema import load_suite

    sc = load_suite(list(scenario_cfg().paths), ["recall"], ["home_city"])[0]
    inst = draw_instances(sc, 1, 0)[0]
    vals = trajectory_values(inst, 6, 0)
    assert len(vals) == 6 and all(a != b for a, b in zip(vals, vals[1:])) and set(vals) <= set(sc.values)
    assert trajectory_values(inst, 6, 0) == vals


def test_agent_with_whole_chunks_recomputed_equals_its_transcript(smol):
    """seam >= chunk length recomputes the chunks: the incremental agent must then decide exactly
    like a full prefill of its own conversation, every turn reusing the whole previous one."""
    res = run_agent(smol, seam=10_000)
    check_schema("agent", res)
    rows = res["rows"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and not res["excluded"]
    assert all(r["kl_transcript"] < EXACT_KL and r["agree_transcript"] for r in rows)
    for prev, r in zip(rows, rows[1:]):
        assert r["reused_tokens"] == prev["conversation_tokens"] and r["value"] != prev["value"]
    assert rows[0]["reused_tokens"] == 0 and rows[0]["precompile_ms"] > 0 == rows[1]["precompile_ms"]


def test_agent_on_a_transcript_suite_recomputing_whole_chunks_equals_its_transcript(smol):
    """On a transcript suite turn 1 is the agent transcript with the unrelated exchanges' tool results
    precompiled, and later turns follow its last user message: with whole chunks recomputed the agent
    decides exactly like a full prefill of its own conversation, each turn reusing the whole previous one."""
    from kvnotes.harness.chunks import transcript_layout
    from kvnotes.scenarios.instances import draw_instances
    from kvnotes.scenarios.schema import load_suite

    res = run_agent(smol, seam=10_000, turns=2, transcript=3)
    check_schema("agent", res)
    rows = res["rows"]
    assert [r["turn"] for r in rows] == [1, 2] and not res["excluded"]
    assert all(r["kl_transcript"] < EXACT_KL and r["agree_transcript"] for r in rows)
    assert rows[1]["reused_tokens"] == rows[0]["conversation_tokens"]
    sc = load_suite(list(scenario_cfg().paths), ["recall"], ["home_city"])[0]
    prompt, spans, names = transcript_layout(smol.tokenizer, draw_instances(sc, 1, 0)[0], rows[0]["value"], turns=3)
    assert rows[0]["conversation_tokens"] == len(prompt.ids) and names == ("tool_1", "tool_2", "tool_3")


def test_a_transcript_conversation_only_appends_to_its_first_turn(smol):
    """A later turn of a transcript conversation extends the earlier one token for token, with the
    chat template and in the plain rendering (a tokenizer without a template, as Gemma-3-270M's):
    the incremental agent can reuse the whole cached conversation."""
    from kvnotes.probes.agent import transcript_conversation
    from kvnotes.scenarios.instances import draw_instances
    from kvnotes.scenarios.schema import load_suite

    sc = load_suite(list(scenario_cfg().paths), ["recall"], ["home_city"])[0]
    inst = draw_instances(sc, 1, 0)[0]
    value = next(iter(sc.values))
    for chat in (True, False):
        one = transcript_conversation(smol.tokenizer, inst, value, "direct", 2, ["x"], [], chat, {})
        two = transcript_conversation(smol.tokenizer, inst, value, "direct", 2, ["x", "Update: moved."], [" Paris"],
                                      chat, {})
        assert two.ids[:len(one.ids)].tolist() == one.ids.tolist() and len(two.ids) > len(one.ids) + 3, chat
        assert two.field == one.field and two.text.endswith(one.text[-20:])


def test_agent_record_aggregates(smol, tmp_path):
    res = run_agent(smol, seam=0, families=("recall", "lookup"), ids=("home_city", "driver_depot"))
    check_figures("agent", res, tmp_path)
    rows, agg = res["rows"], res["aggregates"]["by_family"]
    assert {r["family"] for r in rows} == {"recall", "lookup"} and len(rows) == 6
    for r in rows:
        assert r["agent_correct"] == (r["agent_top1"] == r["expected_first_token"])
        assert r["agree_oracle"] == (r["agent_top1"] == r["oracle_top1"]) and r["kl_oracle"] >= 0
    a = agg["all"]["all"]
    assert a["n_turns"] == 6 and a["n_trajectories"] == 2
    assert a["agent_accuracy"]["k"] == sum(r["agent_correct"] for r in rows)
    assert a["agreement_oracle_owned"]["n"] == sum(r["oracle_owned"] for r in rows)
    assert agg["recall"]["turn2+"]["n_turns"] == 2 and agg["lookup"]["turn1"]["n_turns"] == 1
    t = a["time"]
    assert t["ratio_oracle_over_agent"] == pytest.approx(t["oracle_ms_total"] / t["agent_ms_total"])


# -------------------- the generated readout (scenario.variant=cot)
# The agent loop under chain of thought (probes/agent.py, ``scenario.variant=cot``) on every tiny
# architecture: with zero new tokens the generated readout is the direct one, decision for decision; an
# agent chain that never reaches its marker ends the trajectory at turn 1 with nothing scored; the
# agent's incremental cache, decoded from, decides like a full prefill of its own conversation; a side
# whose chain misses its marker is left out of its metrics, not scored. Then ``run.py`` end to end on
# the embedded SmolLM2.
# 
# The tiny models are the configs of ``tests.helpers.tiny_config`` (every architecture of ``ARCHS``)
# with the embedded SmolLM2 tokenizer's vocabulary, as in ``tests/probes/test_memory.py``: the agent renders
# real scenario conversations, which the ``tiny`` fixture's 96-token vocabulary cannot hold.

#: fp32 on CPU. The cot readout with zero new tokens reads the decision after feeding the last token
#: on a cache over the rest; the direct one reads it from the same forward over all tokens: one more
#: forward, other kernels. Measured |KL difference| <= 6e-7 nats on every tiny architecture.
READOUT_KL_TOL = 1e-5
TURNS = 3
#: Weight std of the tiny models: at the default 0.02 their next-token distributions over 49k tokens
#: are so flat that a wrong token 70 positions back moves the KL by only ~1e-6; at 0.1 by >= 1e-3
#: (llama, qwen3) / >= 7e-5 (gemma2/3), far above EXACT_KL.
INIT_STD = 0.1


def never(tok):
    """A marker test on a token id outside the vocabulary: never generated."""
    return token_marker([len(tok) + 5])


def after(n: int):
    """A marker test reached after ``n`` generated tokens, whatever they are."""
    return lambda ids: len(ids) >= n


@pytest.fixture(scope="module", autouse=True)
def threads():
    """Honour ``OMP_NUM_THREADS`` (conftest sets 2 torch threads; on a loaded 2-core machine two
    threads per process make these small forwards ~30x slower), as tests/probes/test_memory.py does."""
    old = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    yield
    torch.set_num_threads(old)


def tiny_model(arch: str, vocab: int):
    """The tiny config of ``arch`` with ``vocab`` tokens and weights drawn at std
    :data:`INIT_STD` (fp32, CPU)."""
    torch.manual_seed(0)
    cfg = tiny_config(arch)
    cfg.vocab_size, cfg.max_position_embeddings, cfg.initializer_range = vocab, 4096, INIT_STD
    return T.AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tok():
    from kvnotes.models.loading import load_tokenizer
    from kvnotes.models.zoo import zoo_config

    return load_tokenizer(zoo_config("smollm2-135m"))


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tok):
    """A tiny random model of each architecture with the SmolLM2 vocabulary (fp32, CPU)."""
    return tiny_model(request.param, len(tok))


@pytest.fixture(scope="module")
def instance():
    from kvnotes.scenarios.instances import draw_instances
    from kvnotes.scenarios.schema import load_suite

    sc = load_suite(["scenarios/suites"], ["recall"], ["favourite_colour"])[0]
    return draw_instances(sc, 1, 0)[0]


def trajectory(model, tok, instance, cot, seam=0):
    """``cot``: None (the direct readout) or ``(max_new_tokens, marker test)`` of the generated one."""
    values = trajectory_values(instance, TURNS, 0)
    reader = PromptReader("direct", model, tok) if cot is None else PromptReader("generated", model, tok, *cot)
    return run_trajectory(model, tok, instance, values, "cot", seam, "bos", True, {}, reader)


def test_zero_new_tokens_is_the_direct_trajectory(model, tok, instance):
    direct, why_d = trajectory(model, tok, instance, None)
    cot, why_c = trajectory(model, tok, instance, (0, None))
    assert why_d is None and why_c is None and len(direct) == len(cot) == TURNS
    for d, c in zip(direct, cot):
        for key in ("agent_top1", "oracle_top1", "transcript_top1", "expected_first_token", "answer", "oracle_owned",
                    "agent_correct", "agree_oracle", "agree_transcript", "conversation_tokens"):
            assert d[key] == c[key], key
        assert c["kl_oracle"] == pytest.approx(d["kl_oracle"], abs=READOUT_KL_TOL)
        assert c["kl_transcript"] == pytest.approx(d["kl_transcript"], abs=READOUT_KL_TOL)
        assert c["answer_text"] == c["answer"]                                  # an empty chain
        for side in ("agent", "oracle", "transcript"):
            assert c[f"{side}_chain"] == {"ids": [], "length": 0, "marker_at": None, "reached": True,
                                          "stopped": "marker"}
        # the cot cache stops one token short of the conversation: one token less reused
        assert c["reused_tokens"] == max(d["reused_tokens"] - 1, 0)


def test_agent_without_its_marker_ends_the_trajectory_at_turn_one(model, tok, instance):
    rows, why = trajectory(model, tok, instance, (3, never(tok)))
    assert rows == []
    assert why["reason"] == "agent_no_marker" and why["turn"] == 1
    assert why["agent_chain"]["length"] == 3 and not why["agent_chain"]["reached"]
    assert why["agent_chain"]["stopped"] == "max_new_tokens" and why["agent_chain"]["marker_at"] is None


def test_incremental_cache_decides_like_a_full_prefill_of_the_conversation(model, tok, instance):
    """Whole chunks recomputed (seam >= chunk length): the agent's cache, composed at turn 1 and
    extended by only the new tokens later (the previous chain re-forwarded as conversation text),
    generates the transcript's chain and reads its distribution after the marker."""
    rows, why = trajectory(model, tok, instance, (3, after(3)), seam=10_000)
    assert why is None and [r["turn"] for r in rows] == list(range(1, TURNS + 1))
    for r in rows:
        assert r["agent_chain"]["ids"] == r["transcript_chain"]["ids"] and r["agent_chain"]["marker_at"] == 2
        assert abs(r["kl_transcript"]) < EXACT_KL and r["agree_transcript"]
        assert r["answer_text"] == tok.decode(r["agent_chain"]["ids"], skip_special_tokens=True) + r["answer"]
    for prev, r in zip(rows, rows[1:]):
        assert r["reused_tokens"] == prev["conversation_tokens"] - 1          # all it had cached
        assert r["conversation_tokens"] > prev["conversation_tokens"] + prev["agent_chain"]["length"]
    assert rows[0]["precompile_ms"] > 0 == rows[1]["precompile_ms"]
    assert all(r["agent_generate_ms"] > 0 and r["oracle_generate_ms"] > 0 for r in rows)


def test_unreached_sides_are_kept_unscored(model, tok, instance):
    """A marker only the agent's own chains reach (from a first run): the oracle's and transcript's
    chains that differ miss it; their comparisons are None and the aggregates leave them out."""
    first, _ = trajectory(model, tok, instance, (2, after(2)))
    mine = {tuple(r["agent_chain"]["ids"]) for r in first}
    rows, why = trajectory(model, tok, instance, (2, lambda ids: tuple(ids) in mine))
    assert why is None and len(rows) == TURNS
    for r in rows:
        assert r["agent_reached"] and r["agent_correct"] is not None
        for side in ("oracle", "transcript"):
            reached = tuple(r[f"{side}_chain"]["ids"]) in mine
            assert r[f"{side}_reached"] == reached
            assert (r[f"{side}_top1"] is None) == (r[f"{side}_correct"] is None) == (r[f"kl_{side}"] is None) \
                == (r[f"agree_{side}"] is None) == (not reached)
    a = aggregate(rows, ["recall"], 50, 0)["all"]["all"]
    assert a["n_turns"] == TURNS
    for side in ("oracle", "transcript"):
        kept = [r for r in rows if r[f"{side}_reached"]]
        assert a[f"{side}_accuracy"]["n"] == len(kept) and a[f"kl_{side}"]["n"] == len(kept)
        assert a[f"{side}_accuracy"]["k"] == sum(r[f"{side}_correct"] for r in kept)
    assert a["agreement_oracle_owned"]["n"] == sum(bool(r["oracle_owned"]) for r in rows)


@pytest.fixture
def llama_ctx(tok, tmp_path):
    """A probe context on the tiny Llama with the SmolLM2 tokenizer, scenario.variant=cot."""

    from kvnotes.harness.pairs import prepare_pairs

    bundle = type("Bundle", (), {"model": tiny_model("llama", len(tok)), "tokenizer": tok})()
    sc = scenario_cfg(ids=("favourite_colour",))
    sc.variant = "cot"
    probe = probe_yaml("agent")
    probe.progress, probe.n_boot, probe.turns, probe.cot_max_new_tokens = False, 50, 2, 3
    return ProbeContext(bundle=bundle, pairs=prepare_pairs(tok, sc), cfg=probe, seed=0, scenario_cfg=sc)


def test_run_writes_a_generated_record(llama_ctx, monkeypatch, tmp_path):
    from kvnotes.records.tables import record_table

    monkeypatch.setattr(reader_mod, "answer_marker", lambda tok, marker, thinking: after(2))
    res = agent_mod.run(llama_ctx)
    check_schema("agent", res)
    agg = res["aggregates"]
    assert agg["readout"] == "generated" and agg["cot_max_new_tokens"] == 3 and not res["excluded"]
    assert len(res["rows"]) == 2 and all(r["agent_chain"]["length"] == 2 for r in res["rows"])
    assert agg["n_unreached"] == {"agent": 0, **{s: sum(not r[f"{s}_reached"] for r in res["rows"])
                                                 for s in ("oracle", "transcript")}}
    t = agg["by_family"]["all"]["all"]["time"]
    assert t["agent_generate_ms_total"] == pytest.approx(sum(r["agent_generate_ms"] for r in res["rows"]))
    check_figures("agent", res, tmp_path)
    record = json.loads(json.dumps({"probe": "agent", "config": {"probe": {"_target_": "kvnotes.probes.agent.run"}},
                                    "model": {"name": "tiny"}, "scenario": {"name": "t"},
                                    "result": res}))
    assert "| recall | turn 1 |" in record_table(record)
    # the agent's chain never reaches its marker: nothing scored, the trajectory counted
    monkeypatch.setattr(reader_mod, "answer_marker", lambda tok, marker, thinking: never(tok))
    res = agent_mod.run(llama_ctx)
    check_schema("agent", res)
    assert res["rows"] == [] and res["exclusions"] == {"agent_no_marker": 1}
    assert res["excluded"][0]["turn"] == 1 and res["aggregates"]["n_unreached"]["agent"] == 1
    record_table(json.loads(json.dumps({"probe": "agent", "config": {"probe": {"_target_": "kvnotes.probes.agent.run"}},
                                    "model": {"name": "tiny"}, "scenario": {"name": "t"},
                                        "result": res})))


@pytest.mark.embedded
def test_run_py_agent_under_cot(smol, tmp_path):
    rec = job_record(smol, tmp_path, "probe=agent", "scenario=small", "scenario.variant=cot", "scenario.ids=[favourite_colour]",
               "scenario.n_instances=1", "probe.turns=2", "probe.n_boot=50", "probe.progress=false", "plot=false")
    res = rec["result"]
    agg = res["aggregates"]
    assert agg["readout"] == "generated" and agg["cot_max_new_tokens"] == 40
    rows, excluded = res["rows"], res["excluded"]
    # one trajectory: it either ran its 2 turns or ended where the agent's chain missed its marker
    assert len({r["trajectory"] for r in rows} | {e["instance"] for e in excluded}) == 1
    if excluded:
        (e,) = excluded
        assert e["reason"] in ("agent_no_marker", "agent_truncated_in_think") and len(rows) == e["turn"] - 1
        assert agg["n_unreached"]["agent"] == 1 and not e["agent_chain"]["reached"]
    else:
        assert [r["turn"] for r in rows] == [1, 2]
    assert agg["by_family"]["all"]["all"]["n_turns"] == len(rows)
    for side in ("oracle", "transcript"):
        assert agg["n_unreached"][side] == sum(not r[f"{side}_reached"] for r in rows)
    for r in rows:
        assert r["agent_reached"] and r["agent_chain"]["marker_at"] == r["agent_chain"]["length"] - 1
        assert r["answer_text"].endswith(r["answer"]) and len(r["answer_text"]) > len(r["answer"])
        for side in ("agent", "oracle", "transcript"):
            chain = r[f"{side}_chain"]
            assert len(chain["ids"]) == chain["length"] <= 40 and chain["reached"] == r[f"{side}_reached"]
            assert (r[f"{side}_top1"] is None) != chain["reached"]
    if rows:
        assert rows[0]["oracle_chain"] == rows[0]["transcript_chain"]          # turn 1: the same prompt
