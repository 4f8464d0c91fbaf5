"""A run says what it found (:mod:`kvnotes.harness.jobs`): the summary line's counts, and the
warning with the top reason and an example when no decision flipped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvnotes.harness import jobs as outcome


class Tok:
    def decode(self, ids):
        return {7: " for", 8: " twelve", 9: " ten"}[ids[0]]


@pytest.fixture
def pairs(monkeypatch):
    monkeypatch.setattr(outcome, "pair_meta", lambda spec: {"pair": spec})
    ps = [SimpleNamespace(spec=f"p{i}", cand_old=(9,), cand_new=(8,)) for i in range(3)]
    return SimpleNamespace(pairs=ps, excluded=[{"reason": "boundary_merge"}])


def test_summary_counts_flips_and_reasons(pairs):
    rows = [{"pair": "p0", "flips": True}, {"pair": "p1", "flips": False, "reason": "small_effect"},
            {"pair": "p2", "flips": False, "reason": "not_owned"}]
    lines = outcome.outcome_lines({"rows": rows, "exclusions": {"small_effect": 1, "not_owned": 1,
                                                                "boundary_merge": 1, "empty": 0}},
                                  pairs, Tok(), "owned")
    assert lines == ["kvnotes: found: 3 token-aligned pairs (1 more not token-aligned), 1 flip under the owned "
                     "rule; excluded by reason: boundary_merge 1, not_owned 1, small_effect 1"]


def test_no_flip_warns_with_the_top_reason_in_the_models_words(pairs):
    excluded = [{"pair": "p0", "reason": "small_effect", "effect": 0.25},
                {"pair": "p1", "reason": "not_owned", "owns_old": True, "owns_new": False,
                 "top1_id_new": 7, "p_top1_new": 0.8181}]
    res = {"rows": [], "excluded": excluded, "exclusions": {"not_owned": 2, "small_effect": 1}}
    found, warning = outcome.outcome_lines(res, pairs, Tok(), "owned")
    assert "0 flip under the owned rule" in found
    assert warning.startswith("kvnotes: warning: no decision flipped under the owned rule")
    assert "top reason is not_owned (2 pairs)" in warning
    assert "pair p1: the new run's top-1 is ' for' (p=0.818), not the expected ' twelve'" in warning
    res["exclusions"] = {"small_effect": 3}
    assert "e.g. pair p0: effect +0.250 nats" in outcome.outcome_lines(res, pairs, Tok(), "relative")[1]


def test_probes_without_pairs_say_nothing():
    assert outcome.outcome_lines({"rows": [{"x": 1}]}, SimpleNamespace(pairs=[], excluded=[]), Tok(), "owned") == []


def test_a_probe_reporting_every_pair_counts_its_non_flipping_rows(pairs):
    rows = [{"pair": "p0", "flips": True}, {"pair": "p1", "flips": False, "reason": "not_owned"},
            {"pair": "p2", "flips": False, "reason": "not_owned"}]
    assert outcome.outcome_lines({"rows": rows, "exclusions": {}}, pairs, Tok(), "owned")[0].endswith(
        "1 flip under the owned rule; excluded by reason: not_owned 2")
