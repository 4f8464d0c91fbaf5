"""LoCoMo (kvnotes.scenarios.locomo, kvnotes.cli.locomo): the loader on a small file in the published
format that the tests write, one-line rejection of malformed files, the answer metrics on known
strings, and the composed-vs-full QA runner on tiny random models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvnotes.scenarios.errors import ScenarioError
from kvnotes.scenarios.locomo import contains, load_locomo, normalize_answer, render_session, token_f1
from tests.helpers import HANG_S, LOGPROB_TOL, VOCAB, build_tiny, run_kvnotes

ROOT = Path(__file__).resolve().parents[2]
#: F1 values computed by hand from token counts.
F1_TOL = 1e-12
#: A rotated chunk that was precompiled without the sessions before it changes the first-step
#: log-probs by far more than float error (tiny random models: ~5e-3).
SPLICE_EFFECT = 1e-3
#: One-session composed vs full first-step log-probs on the embedded SmolLM2-135M (measured 3.4e-5
#: on CPU: the same computation in a different order of forwards).
EMBEDDED_TOL = 1e-3


def sample(sid: str, n_sessions: int, short: bool = False) -> dict:
    """A sample in the layout of LoCoMo's data/locomo10.json (sessions written out of order, plus
    the keys the loader ignores); ``short`` sessions fit the tiny models' 256 positions as characters."""
    conv: dict = {"speaker_b": "Bob", "speaker_a": "Ann"}
    for n in reversed(range(1, n_sessions + 1)):
        conv[f"session_{n}"] = [{"speaker": "Ann", "dia_id": f"D{n}:1", "text": f"I moved to Oslo in 20{10 + n}."}]
        if not short:
            conv[f"session_{n}"].append({"speaker": "Bob", "dia_id": f"D{n}:2", "text": "Nice!",
                                         "img_url": ["http://x/y.jpg"], "blip_caption": "a photo of a fjord",
                                         "query": "fjord"})
        conv[f"session_{n}_date_time"] = f"{n} May" if short else f"1:56 pm on {n} May, 2023"
    qa = [{"question": "Where did Ann move?", "answer": "Oslo", "evidence": ["D1:1"], "category": 4},
          {"question": "When did Ann move?", "answer": 2011, "evidence": ["D1:1"], "category": 2},
          {"question": "What did Bob adopt?", "adversarial_answer": "a cat", "evidence": [], "category": 5}]
    return {"sample_id": sid, "conversation": conv, "qa": qa, "event_summary": {}, "observation": {},
            "session_summary": {}}


def write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_loader_reads_the_format(tmp_path):
    samples = load_locomo(write(tmp_path / "locomo.json", [sample("conv-1", 12), sample("conv-2", 1)]))
    assert [s.sample_id for s in samples] == ["conv-1", "conv-2"]
    conv = samples[0].conversation
    assert (conv.speaker_a, conv.speaker_b) == ("Ann", "Bob")
    assert list(conv.sessions) == [f"session_{n}" for n in range(1, 13)]         # numeric order, not text order
    s1 = conv.sessions["session_1"]
    assert s1.index == 1 and s1.date_time == "1:56 pm on 1 May, 2023" and len(s1.turns) == 2
    assert s1.turns[1].blip_caption == "a photo of a fjord"
    qa = samples[0].qa
    assert [q.category for q in qa] == [4, 2, 5]
    assert [q.gold for q in qa] == ["Oslo", "2011", "a cat"]                     # a numeric answer becomes text
    assert render_session(s1) == ("1:56 pm on 1 May, 2023\nAnn: I moved to Oslo in 2011.\n"
                                  "Bob: Nice! [shares: a photo of a fjord]")


def _broken(kind: str):
    good = sample("conv-1", 2)
    if kind == "not_json":
        return '[{"sample_id": "conv-1",'
    if kind == "not_list":
        return good
    if kind == "missing_speaker":
        del good["conversation"]["speaker_a"]
    elif kind == "turn_text_type":
        good["conversation"]["session_2"][1]["text"] = ["not", "text"]
    elif kind == "session_not_list":
        good["conversation"]["session_1"] = "hello"
    elif kind == "category_type":
        good["qa"][1]["category"] = "temporal"
    elif kind == "no_answer":
        del good["qa"][0]["answer"]
    elif kind == "no_sessions":
        good["conversation"] = {"speaker_a": "Ann", "speaker_b": "Bob"}
    return [good]


@pytest.mark.parametrize("kind, words", [
    ("not_json", "not JSON"),
    ("not_list", "top level: Input should be a valid list"),
    ("missing_speaker", "[0].conversation.speaker_a: Field required"),
    ("turn_text_type", "[0].conversation.session_2.turns[1].text: Input should be a valid string"),
    ("session_not_list", "[0].conversation.session_1.turns: Input should be a valid list"),
    ("category_type", "[0].qa[1].category: Input should be a valid integer"),
    ("no_answer", "[0].qa[0]: Value error, a question needs 'answer' or 'adversarial_answer'"),
    ("no_sessions", "[0].conversation: Value error, no session_N keys"),
])
def test_loader_rejects_malformed_file_in_one_line(tmp_path, kind, words):
    path = write(tmp_path / f"{kind}.json", _broken(kind))
    with pytest.raises(ScenarioError) as err:
        load_locomo(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and words in msg, msg


def test_command_rejects_malformed_file_in_one_line(tmp_path):
    """``kvnotes locomo`` reports a malformed file as one line and exit status 2 (before any model loads)."""
    path = write(tmp_path / "bad.json", _broken("category_type"))
    proc = subprocess.run([sys.executable, "-c", "from kvnotes.cli import main; main()", "locomo", "--data",
                           str(path)], capture_output=True, text=True, cwd=ROOT, timeout=HANG_S)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvnotes: error: {path}: [0].qa[1].category")


def test_normalize_answer():
    assert normalize_answer("  The Cat, sat on A mat!  ") == "cat sat on mat"
    assert normalize_answer("An apple-pie.") == "applepie"                  # SQuAD drops punctuation in place
    assert normalize_answer(2022) == "2022"


@pytest.mark.parametrize("pred, gold, f1", [
    ("7 May 2023", "May 7, 2023", 1.0),                                     # bag of tokens: order free
    ("on 7 May", "7 May 2023", 2 / 3),                                      # P = R = 2/3
    ("Oslo Oslo", "Oslo", 2 * (1 / 2) * 1 / (1 / 2 + 1)),                   # P = 1/2 (one Oslo counts), R = 1
    ("Bergen", "Oslo", 0.0),
    ("the", "a", 1.0),                                                      # both normalise to nothing
    ("", "Oslo", 0.0),
])
def test_token_f1(pred, gold, f1):
    assert token_f1(pred, gold) == pytest.approx(f1, abs=F1_TOL)


@pytest.mark.parametrize("pred, gold, expected", [
    ("She went there on 7 May, 2023.", "7 May 2023", True),
    ("17 May 2023", "7 May 2023", False),                                   # whole tokens only
    ("May 7 2023", "7 May 2023", False),                                    # contiguous, in order
    ("The answer is OSLO", "oslo", True),
    ("", "the", True),
])
def test_contains(pred, gold, expected):
    assert contains(pred, gold) is expected


class CharTokenizer:
    """A character tokenizer over the tiny models' 96-token vocabulary: newline and printable ASCII."""

    CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
    eos_token_id = unk_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [self.CHARS.index(c) if c in self.CHARS else self.CHARS.index("?") for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.CHARS[i] for i in ids)

    def convert_tokens_to_ids(self, token):
        return None


assert len(CharTokenizer.CHARS) == VOCAB


@pytest.fixture(scope="module")
def tiny_samples(tmp_path_factory):
    path = write(tmp_path_factory.mktemp("locomo") / "locomo.json", [sample("one", 1, True), sample("two", 2, True)])
    return load_locomo(path)


RECORD_KEYS = {"sample_id", "qa_index", "category", "question", "gold", "sessions_kept", "prompt_tokens", "composed",
               "full", "first_step", "same_answer"}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_runner_one_session_equals_full_prefill(arch, tiny_samples):
    """With one session the chunk sits where it was precompiled (behind the header as its sink), so the
    composed arm's first-step log-probs equal the full prefill's; with two, the second session's chunk
    was precompiled without the first and differs."""
    from kvnotes.probes.locomo import run_locomo_qa
    from kvnotes.probes.locomo import format_summary

    model = build_tiny(arch)
    res = run_locomo_qa(model, CharTokenizer(), tiny_samples, max_new_tokens=4, rotate=True, seam=0)
    recs = res["records"]
    assert [(r["sample_id"], r["qa_index"]) for r in recs] == [("one", 0), ("one", 1), ("two", 0), ("two", 1)]
    for r in recs:
        assert set(r) == RECORD_KEYS
        assert set(r["composed"]) == set(r["full"]) == {"answer", "f1", "contains", "stopped", "new_tokens"}
        assert 0 <= r["composed"]["f1"] <= 1 and r["full"]["new_tokens"] <= 4
    one = [r for r in recs if r["sample_id"] == "one"]
    two = [r for r in recs if r["sample_id"] == "two"]
    assert all(r["sessions_kept"] == [1] and r["first_step"]["max_abs_diff"] <= LOGPROB_TOL for r in one)
    assert all(r["same_answer"] and r["composed"] == r["full"] for r in one)
    assert all(r["sessions_kept"] == [1, 2] and r["first_step"]["max_abs_diff"] > SPLICE_EFFECT for r in two)
    s = res["summary"]
    assert s["n_questions"] == 4 and s["n_samples"] == 2
    assert s["mcnemar"]["n"] == 4 and s["f1_tost"]["n_clusters"] == 2
    assert s["first_step_kl"]["n_scenarios"] == 2
    text = format_summary(res, arch)
    assert text.startswith(f"# locomo QA: {arch}; 4 question(s) from 2 conversation(s)") and "exact McNemar" in text


def test_runner_full_seam_and_truncation(tiny_samples):
    """A seam covering the whole chunk recomputes it, which is the full prefill (two sessions too);
    a context that holds only the last session keeps it and says so."""
    from kvnotes.probes.locomo import run_locomo_qa

    model = build_tiny("llama")
    res = run_locomo_qa(model, CharTokenizer(), tiny_samples[1:], max_questions=1, max_new_tokens=2, seam=10_000)
    (r,) = res["records"]
    assert r["sessions_kept"] == [1, 2] and r["first_step"]["max_abs_diff"] <= LOGPROB_TOL
    logs: list[str] = []
    full_len = res["records"][0]["prompt_tokens"]
    res = run_locomo_qa(model, CharTokenizer(), tiny_samples[1:], max_questions=1, max_new_tokens=2,
                        max_context=full_len - 10, log=logs.append)
    (r,) = res["records"]
    assert r["sessions_kept"] == [2] and r["first_step"]["max_abs_diff"] <= LOGPROB_TOL
    assert len(logs) == 1 and "kept the last 1 session(s)" in logs[0] and "\n" not in logs[0]
    assert res["summary"]["f1_tost"] == {"skipped": "tost: 1 cluster(s); an equivalence test over cluster means "
                                                    "needs at least 2"}


@pytest.mark.embedded
def test_command_on_embedded_model(tmp_path, monkeypatch, capsys):
    """``kvnotes locomo`` end to end on the embedded SmolLM2-135M: ``probe=locomo`` through the job path
    writes its record (the LoCoMo file among its inputs), prints the summary and writes the JSON; a
    second call reuses the record, and an edited file runs the job again."""
    data = write(tmp_path / "locomo.json", [sample("one", 1), sample("two", 2)])
    out = tmp_path / "out.json"
    args = ["locomo", "--data", data, "--max-questions", "3", "--max-new-tokens", "8", "--json", out,
            "--out-root", tmp_path / "runs", "--device", "cpu"]
    monkeypatch.chdir(tmp_path)
    ran = run_kvnotes(monkeypatch, capsys, *args)
    assert ran.returncode == 0, ran.stderr
    stdout = ran.stdout
    assert "\n# locomo QA: smollm2-135m; 3 question(s) from 2 conversation(s)" in stdout, stdout
    rec = json.loads(out.read_text())
    assert len(rec["records"]) == 3 and rec["records"][0]["first_step"]["max_abs_diff"] <= EMBEDDED_TOL
    (path,) = (tmp_path / "runs" / "smollm2-135m" / "locomo").rglob("record.json")
    assert path.relative_to(tmp_path / "runs").parts[2].startswith("locomo~")    # the suite part names the data file
    record = json.loads(path.read_text())
    assert record["result"]["rows"] == rec["records"] and record["config"]["probe"]["data"] == str(data)
    assert "is complete; skipping" in run_kvnotes(monkeypatch, capsys, *args).stdout
    write(data, [sample("one", 1)])
    edited = run_kvnotes(monkeypatch, capsys, *args).stdout
    assert "computed from other inputs (scenario files changed)" in edited, edited
    assert "# locomo QA: smollm2-135m; 2 question(s) from 1 conversation(s)" in edited
