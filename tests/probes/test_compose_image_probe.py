"""``probe=compose`` with ``probe.image_chunk=true`` end to end (issue #24 item 3): the shrunk random-weight
Qwen3-VL-2B zoo entry through ``run.py``'s job path (:func:`kvnotes.harness.jobs.run_job`), prompts rendered
with the embedded SmolLM2 tokenizer; the record says the image arm ran and reports it against the full
prefill with the image encoded. A model without a vision tower is refused in one line."""

from __future__ import annotations

import json

import pytest

from kvnotes.errors import KvnotesError
from tests.lanes.test_zoo import compose_cfg

pytestmark = pytest.mark.embedded

MODEL = "qwen3-vl-2b"
EXTRA = ["probe.image_chunk=true", "probe.image_grid=[1,4,4]", "probe.seams=[0]", "probe.sinks=[bos]",
         "probe.edit_arm_seams=[]", "scenario.n_instances=1"]
#: KL(full || composed) in nats is finite and non-negative up to fp32 rounding of the log-softmax.
KL_FLOOR = -1e-5


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    from kvnotes.harness.jobs import load_bundle, run_job

    cfg = compose_cfg(MODEL, "compose", EXTRA)
    bundle = load_bundle(cfg)
    path = run_job(cfg, tmp_path_factory.mktemp("img"), {"launcher": "test"}, log=lambda _: None, bundle=bundle)
    return json.loads(path.read_text())


def test_record_says_the_image_arm_ran_and_reports_it(record):
    assert record["status"] == "complete" and record["probe"] == "compose"
    assert record["model"]["source"] == "random" and record["config"]["probe"]["image_chunk"] is True
    img = record["result"]["aggregates"]["image_chunk"]
    assert img["enabled"] and img["grid"] == [1, 4, 4] and img["n_tokens"] == 4 + 2 and img["seam"] == 0
    assert set(img["variants"]) == {"rotate/sink=bos/seam=0", "no_rotate/sink=bos/seam=0"}
    prompts = record["result"]["prompts"]
    assert prompts and all("image_chunk" in p for p in prompts)
    for name, v in img["variants"].items():
        assert v["top1_agreement"]["n"] == len(prompts), name
        assert v["kl"]["all"]["n"] == len(prompts), name
        for p in prompts:
            assert p["image_chunk"]["variants"][name]["kl"] > KL_FLOOR
    # the text arms are reported as before
    assert "rotate/sink=bos/seam=0" in record["result"]["aggregates"]["variants"]


def test_image_chunk_on_a_text_model_is_refused_in_one_line():
    from kvnotes.ops import mrope
    from tests.helpers import build_tiny

    with pytest.raises(KvnotesError) as err:
        mrope.synthetic_image(build_tiny("llama"), (1, 4, 4))
    assert "\n" not in str(err.value)
