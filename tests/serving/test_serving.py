"""Serving traces (kvnotes.serving) and the vLLM prefix-cache experiment (kvnotes.cli.serve_bench).

The trace test needs only the embedded model's tokenizer. The engine test is marked ``serving``: it
needs the serving environment (``bash scripts/install.sh --serving``) and runs only there::

    .venv-serving/bin/python -m pytest -m serving tests/serving/test_serving.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from kvnotes.models.loading import materialise_embedded

    from omegaconf import OmegaConf

    path, _ = materialise_embedded(OmegaConf.load(ROOT / "conf" / "model" / "smollm2-135m.yaml").embedded)
    return AutoTokenizer.from_pretrained(path)


@pytest.mark.embedded
def test_trace_layouts(tokenizer):
    """In-place turns differ from turn 0 from the field on; erratum turns extend turn 0's tokens up to
    the appended notice; the hoisted field stands after the shared document; positions move the field."""
    from kvnotes.serving import build_trace
    from kvnotes.scenarios import load_suite
    from kvnotes.harness.edit_prompts import common_prefix_length

    scs = load_suite([str(ROOT / "scenarios/suites")], ids=["home_city"])
    reqs, excluded = build_trace(tokenizer, scs, 1, 3, 200, ["early", "late"], ["in_place", "erratum", "hoist"])
    assert not excluded
    get = {(r.arm, r.position, r.turn): r for r in reqs}
    for pos in ("early", "late"):
        t0 = get["in_place", pos, 0]
        assert t0.ids == get["erratum", pos, 0].ids
        for t in (1, 2):
            ip, er = get["in_place", pos, t], get["erratum", pos, t]
            assert common_prefix_length(*map(_tensor, (t0.ids, ip.ids))) == t0.field_token
            assert ip.expected_token != t0.expected_token       # the field changes the answer each turn
            assert len(er.ids) > len(t0.ids) and er.field_token == t0.field_token
            # the erratum keeps everything before the request: the reused prefix reaches past the document
            assert common_prefix_length(*map(_tensor, (t0.ids, er.ids))) > len(t0.ids) - 60
        hoist = get["hoist", pos, 1]
        assert hoist.field_token > len(hoist.ids) - 60
    assert get["in_place", "early", 0].field_token < 80 < len(get["in_place", "early", 0].ids) - 150
    assert get["in_place", "late", 0].field_token > 200


@pytest.mark.embedded
def test_reused_reference_equals_the_full_prefill(tokenizer, smol, monkeypatch):
    """``reference_decisions(method="reuse")`` continues each session's previous prompt from the common
    prefix (the erratum turns from turn 0) and gives the full prefill's decisions to float rounding."""
    import kvnotes.serving.trace as serving
    from kvnotes.scenarios import load_suite

    scs = load_suite([str(ROOT / "scenarios/suites")], ids=["home_city"])
    reqs, _ = serving.build_trace(tokenizer, scs, 1, 3, 200, ["early"], ["in_place", "erratum"])
    full, _ = serving.reference_decisions(smol.model, reqs, method="full")
    starts = []
    cont = serving._continued_logprobs
    monkeypatch.setattr(serving, "_continued_logprobs", lambda m, c, n, ids: starts.append(n) or cont(m, c, n, ids))
    reuse, _ = serving.reference_decisions(smol.model, reqs, method="reuse")
    assert reuse.keys() == full.keys()
    for ids, ref in full.items():
        assert reuse[ids]["top1"] == ref["top1"]
        for o, lp in ref["cand_logprobs"].items():
            assert reuse[ids]["cand_logprobs"][o] == pytest.approx(lp, abs=REFERENCE_TOL)
    assert sum(n > 0 for n in starts) >= 2                     # the erratum turns continued turn 0


#: nats: the same prompt's candidate log-probs, full prefill vs a continued cache (fp32 rounding).
REFERENCE_TOL = 1e-4


def _tensor(ids):
    import torch

    return torch.tensor(ids)


@pytest.mark.serving
def test_engine_erratum_keeps_prefix_cache(tmp_path):
    """On a short trace served by vLLM: the erratum arm's hit rate exceeds the in-place arm's, the
    cache is cold at each run's start, every sent answer is scored, and the engine's candidate
    log-probs match the harness's full prefill."""
    pytest.importorskip("vllm")
    cmd = [sys.executable, "-m", "kvnotes.cli.serve_bench", "--sessions", "2", "--turns", "2",
           "--doc-tokens", "192", "--positions", "early", "--arms", "in_place,erratum", "--rates", "2",
           "--cross-check", "2", "--out-root", str(tmp_path), "--name", "test", "--no-plot"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads((tmp_path / "smollm2-135m" / "test" / "record.json").read_text())
    res = rec["result"]
    table = res["aggregates"]["by_run"]
    er, ip = table["erratum"]["early"]["2.0"], table["in_place"]["early"]["2.0"]
    assert er["hit_rate_updates"] > ip["hit_rate_updates"]
    assert er["engine_hit_rate"] > ip["engine_hit_rate"]
    for run in res["runs"]:
        assert run["reset_ok"] and run["first_request_cached_tokens"] == 0
    sent = [r for r in res["rows"] if r["sent"]]
    assert sent and all(isinstance(r["owned"], bool) and isinstance(r["agree"], bool)
                        and isinstance(r["served_correct"], bool) for r in sent)
    assert er["agreement"]["n"] == er["n_sent"] and ip["agreement"]["n"] == ip["n_sent"]
    assert res["cross_check"]["within_tolerance"], res["cross_check"]["max_abs_diff_candidates"]


@pytest.mark.serving
def test_engine_connector_arms(tmp_path):
    """serve-bench's connector arms on a short trace: composed and edited requests carry their
    provenance label and a first-token KL against the full prefill, the baselines are full prefills,
    every answer is scored, and the speedups over the baselines are in the aggregates."""
    pytest.importorskip("vllm")
    cmd = [sys.executable, "-m", "kvnotes.cli.serve_bench", "--sessions", "2", "--turns", "2",
           "--doc-tokens", "256", "--chunk-tokens", "64", "--positions", "early",
           "--arms", "composed,composed_cold,edited,cold", "--rates", "2", "--cross-check", "1",
           "--out-root", str(tmp_path), "--name", "test", "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "smollm2-135m" / "test" / "record.json").read_text())["result"]
    sent = [r for r in res["rows"] if r["sent"]]
    want = {"composed": "composed", "composed_cold": "full_prefill", "cold": "full_prefill"}
    for r in sent:
        planned = r["arm"] == "composed" or (r["arm"] == "edited" and r["turn"] > 0)
        assert r["path"] == want.get(r["arm"], "edited" if planned else "full_prefill"), r
        assert (r.get("kl_first_token") is not None) == planned
        if planned:
            assert 0 <= r["kl_first_token"] < 10 and r["loaded_tokens"] > 0.5 * r["n_prompt"]
        assert isinstance(r["agree"], bool) and isinstance(r["served_correct"], bool)
    assert {r["arm"] for r in sent} == {"composed", "composed_cold", "edited", "cold"}
    speed = res["aggregates"]["p90_ttft_speedup_vs_full"]
    assert speed["composed"]["composed"]["2.0"] > 0 and speed["edited"]["early"]["2.0"] > 0


def test_missing_engine_is_one_line(tmp_path):
    """Without vLLM in the environment the script stops with one error line and status 2."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; the serving test covers this environment")
    proc = subprocess.run([sys.executable, "-m", "kvnotes.cli.serve_bench", "--out-root", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvnotes: error: vLLM is not installed"), proc.stderr


@pytest.mark.serving
def test_engine_start_failure_is_one_line(tmp_path):
    """An engine that cannot start (a context longer than the model allows) gives one error line."""
    pytest.importorskip("vllm")
    cmd = [sys.executable, "-m", "kvnotes.cli.serve_bench", "--sessions", "1", "--turns", "1",
           "--doc-tokens", "32", "--positions", "late", "--arms", "in_place", "--rates", "1",
           "--cross-check", "1", "--max-model-len", "1000000", "--out-root", str(tmp_path), "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("kvnotes: error:")]
    assert len(lines) == 1 and "vLLM engine could not start" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
