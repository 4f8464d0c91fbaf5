"""The ground-truth lane (issue #36): the probes' conclusions scored against planted-mechanism
models whose notes, heads and field share are known by construction (:mod:`kvnotes.models.planted`).
Each probe's scores live in its own test file, in tests marked ``@pytest.mark.planted("<probe>")``
(the models, suites and bars: tests/planted.py); the lane checks the constructions themselves and
discovers that every probe is scored, or says why it cannot be. It names no probe."""

from __future__ import annotations

import json
import re

import pytest

import kvnotes.probes
from kvnotes.cli.errors import conf_names
from tests.helpers import ROOT
from tests.planted import planted_context, planted_truth
from kvnotes.models import planted, zoo


def test_the_checkpoint_carries_its_truth(planted_cache, monkeypatch):
    # any probe's config: the checkpoint is the model's, whichever probe's context loads it
    ctx = planted_context(planted_cache, monkeypatch, "distributed", min(conf_names("probe")))
    truth = planted_truth(ctx)
    assert truth["family"] == "distributed" and truth["notes"]["weights"] == pytest.approx([0.5, 0.3, 0.2])
    written = next((planted_cache / "planted").glob("distributed-*/config.json"))
    on_disk = json.loads(written.read_text())[planted.TRUTH_KEY]
    assert on_disk == json.loads(json.dumps(truth))
    assert ctx.bundle.info["source"] == "planted"
    with pytest.raises(Exception, match="model.planted.family"):
        planted.PlantedSpec.of({"family": "nope"})
    with pytest.raises(Exception, match=r"model.planted.alpha: must be in \[0, 1\]"):
        planted.PlantedSpec.of({"family": "mixed", "alpha": 2})
    with pytest.raises(Exception, match="model.planted.weights"):
        planted.PlantedSpec.of({"family": "distributed", "weights": [0, 1]})


@pytest.mark.parametrize("name", ["planted-notes", "planted-gemma"])
def test_the_architecture_block_is_the_construction(name):
    """``conf/model/_planted.yaml``'s and ``_planted_gemma.yaml``'s architecture blocks (the zoo lane
    builds from them) are the constructions' own configs."""
    cfg = zoo.zoo_config(name)
    built = planted.build(planted.PlantedSpec.of(cfg.planted))[0].config
    data = zoo.architecture_config(cfg)
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "intermediate_size", "tie_word_embeddings", "rms_norm_eps", "model_type"]
    if name == "planted-gemma":
        keys += ["sliding_window", "layer_types", "query_pre_attn_scalar", "final_logit_softcapping",
                 "attn_logit_softcapping"]
    assert {k: getattr(data, k) for k in keys} == {k: getattr(built, k) for k in keys}
    assert data.rope_parameters == built.rope_parameters


def planted_scored() -> dict[str, list[str]]:
    """Probe -> the tests that score it against the planted truth: every test marked
    ``@pytest.mark.planted("<probe>")`` anywhere under ``tests/`` (a probe's own test file included)."""
    out: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for name in re.findall(r'@pytest\.mark\.planted\("(\w+)"\)', path.read_text()):
            out.setdefault(name, []).append(path.name)
    return out


def test_the_lane_names_every_probe():
    """Every probe is scored against the planted truth (a test marked ``planted``) or its module says
    why it cannot be (``PLANTED_NOT_SCORED``): the lane discovers both, it names no probe; and
    docs/results/planted.md's scorecard has a row for every scored probe."""
    names = set(conf_names("probe"))
    scored = set(planted_scored())
    not_scored = {n for n in names if getattr(kvnotes.probes.module(n), "PLANTED_NOT_SCORED", None)}
    assert scored <= names, f"planted tests of unknown probes: {sorted(scored - names)}"
    assert scored | not_scored == names, f"neither scored nor declared not scored: {sorted(names - scored - not_scored)}"
    assert not scored & not_scored, f"scored and declared not scored: {sorted(scored & not_scored)}"
    doc = (ROOT / "docs" / "results" / "planted.md").read_text()
    assert all(f"`{name}`" in doc for name in scored)
