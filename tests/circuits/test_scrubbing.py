"""``scrubbing`` (docs/probes/scrubbing.md): on the planted constructions the note set is the planted
marker, its interchange recovery is the planted notes share ``1 - alpha``, and a same-conclusion
donor of another length (positions carried by alignment, keys moved by RoPE) changes nothing."""

from __future__ import annotations

import pytest

import kvnotes.probes
from kvnotes.circuits.scrubbing import position_map
from tests.helpers import check_figures
from tests.planted import BAR, planted_context, planted_truth

#: recovery units: a same-conclusion donor's notes carry the same one-hot (fp32 and the norm's
#: constant component)
SAME = 1e-3


def test_equal_gaps_between_matched_blocks_pair_in_order():
    # base "a X b c" vs donor "a Y b Z Z c": X~Y (gap of 1 each side), the donor's two Z have no base partner
    assert position_map([1, 9, 2, 7, 7, 3], [1, 8, 2, 3]) == {0: 0, 1: 1, 2: 2, 3: 5}
    assert position_map([5, 6], [5, 6]) == {0: 0, 1: 1}


@pytest.mark.planted("scrubbing")
def test_planted_note_set_interchange_and_drift(planted_arch, planted_cache, monkeypatch, tmp_path):
    ctx = planted_context(planted_cache, monkeypatch, "mixed", "scrubbing", {"planted": {"alpha": 0.3}}, {},
                          n_instances=4, arch=planted_arch)
    res = kvnotes.probes.get(ctx.cfg)(ctx)
    agg = res["aggregates"]
    alpha = planted_truth(ctx)["alpha"]
    assert agg["n_scrubbed"] >= 6 and agg["n_drift"] == agg["n_scrubbed"], res["warnings"]
    tok = ctx.bundle.tokenizer
    pairs = {p.spec.id: p for p in ctx.pairs.pairs}
    markers = set(planted_truth(ctx)["notes"]["tokens"])
    for r in res["rows"]:
        if "interchange" not in r:
            continue
        assert [tok.convert_ids_to_tokens(int(pairs[r["pair"]].old.ids[p])) for p in r["note_set"]] == ["note"]
        assert markers == {"note"}
        assert r["interchange"]["notes"] == pytest.approx(1 - alpha, abs=BAR)
        assert abs(r["interchange"]["rest"]) < BAR and abs(r["interchange"]["random"]) < BAR
        assert max(r["drift"].values()) < SAME and min(r["logit_cosine"].values()) > 1 - SAME
        assert r["unmapped"]["notes"] == 0
    assert agg["checks"]["max_unscrubbed_score_error"] < 1e-4
    assert agg["checks"]["selection_pairs_in_heldout"] == 0
    if planted_arch == "llama":
        check_figures("scrubbing", res, tmp_path)
