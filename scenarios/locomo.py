"""LoCoMo conversations and their questions (issue #21, part 4): the loader and the answer metrics.

LoCoMo (Maharana et al. 2024, "Evaluating Very Long-Term Conversational Memory of LLM Agents",
ACL 2024; https://github.com/snap-research/locomo) publishes ``data/locomo10.json``: a JSON list of
samples, each

- ``sample_id``: a string;
- ``conversation``: ``speaker_a``, ``speaker_b`` and, for ``N = 1, 2, ...``, ``session_N`` (a list of
  turns ``{"speaker", "dia_id": "DN:i", "text"}``, optionally ``img_url`` and ``blip_caption`` for a
  shared image) and ``session_N_date_time`` (a string such as ``"1:56 pm on 8 May, 2023"``);
- ``qa``: a list of ``{"question", "answer", "evidence": [dia_id, ...], "category": int}``; adversarial
  questions (category 5) carry ``adversarial_answer`` and may lack ``answer``. Answers may be numbers.

Other keys (``event_summary``, ``observation``, ``session_summary``, ...) are ignored. The dataset is
not shipped; :func:`load_locomo` reads a copy the user has. This module is data code of the
``scenarios`` package, so a malformed file raises the package's one-line
:class:`kvnotes.scenarios.errors.ScenarioError` (reported like :class:`kvnotes.errors.KvnotesError`).

Metrics (:func:`normalize_answer`, :func:`token_f1`, :func:`contains`) follow the SQuAD v1.1
evaluation script (Rajpurkar et al. 2016): lower case, punctuation and the articles a/an/the removed,
whitespace collapsed; F1 over the bags of normalised tokens. LoCoMo's own script also drops "and"
and stems with Porter; this one does not, so its F1 is not the paper's number.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, model_validator

from kvnotes.scenarios.errors import ScenarioError

_SESSION = re.compile(r"^session_(\d+)$")


class Turn(BaseModel):
    """One utterance of a session (``blip_caption`` describes an image the speaker shared)."""

    model_config = ConfigDict(extra="ignore")
    speaker: str
    dia_id: str
    text: str
    blip_caption: str | None = None


class Session(BaseModel):
    """``session_N`` with its ``session_N_date_time`` (None when the file has none)."""

    index: int
    date_time: str | None = None
    turns: list[Turn]


class Conversation(BaseModel):
    """``conversation`` of a sample: the two speakers and the sessions by key (``"session_N"``), in
    order of ``N``."""

    model_config = ConfigDict(extra="forbid")
    speaker_a: str
    speaker_b: str
    sessions: dict[str, Session]

    @model_validator(mode="before")
    @classmethod
    def _collect_sessions(cls, data):
        """Gather ``session_N`` / ``session_N_date_time`` keys into :attr:`sessions` (others are dropped)."""
        if not isinstance(data, dict):
            return data
        out = {k: data[k] for k in ("speaker_a", "speaker_b") if k in data}
        found = sorted((int(m.group(1)), k) for k in data if (m := _SESSION.match(k)))
        if not found:
            raise ValueError("no session_N keys")
        out["sessions"] = {k: {"index": n, "date_time": data.get(f"{k}_date_time"), "turns": data[k]} for n, k in found}
        return out


class QA(BaseModel):
    """A question with its gold answer (``answer``, or ``adversarial_answer`` for category 5)."""

    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)
    question: str
    answer: str | None = None
    adversarial_answer: str | None = None
    evidence: list[str] = []
    category: int

    @model_validator(mode="after")
    def _has_answer(self):
        if self.answer is None and self.adversarial_answer is None:
            raise ValueError("a question needs 'answer' or 'adversarial_answer'")
        return self

    @property
    def gold(self) -> str:
        """The answer scored against (``answer``, else ``adversarial_answer``)."""
        return self.answer if self.answer is not None else str(self.adversarial_answer)


class LocomoSample(BaseModel):
    """One conversation of the dataset with its questions."""

    model_config = ConfigDict(extra="ignore", coerce_numbers_to_str=True)
    sample_id: str
    conversation: Conversation
    qa: list[QA]


_SAMPLES = TypeAdapter(list[LocomoSample])


def _where(loc: tuple) -> str:
    """A validation error's location as a path into the file: ``(0, 'conversation', 'sessions',
    'session_2', 'turns', 2, 'text')`` -> ``[0].conversation.session_2.turns[2].text``."""
    out = ""
    for part in loc:
        if part != "sessions":
            out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".") or "top level"


def load_locomo(path: str | Path) -> list[LocomoSample]:
    """Read and validate a LoCoMo file (the ``locomo10.json`` format, module docstring).

    Args:
        path: the JSON file.

    Returns:
        the samples in file order; each conversation's sessions sorted by ``N``.

    Raises:
        ScenarioError: one line naming the file and the first problem: unreadable, not JSON, not a
            list, a missing key or a value of the wrong type (with its location, e.g.
            ``[0].qa[3].category``), a conversation without sessions, a question without an answer.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: not JSON ({str(exc).splitlines()[0]})") from None
    try:
        samples = _SAMPLES.validate_python(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        msg = " ".join(str(e["msg"]).split())
        raise ScenarioError(f"{path}: {_where(e['loc'])}: {msg} (LoCoMo format: a list of samples with "
                            f"sample_id, conversation, qa; {exc.error_count()} problem(s))") from None
    if not samples:
        raise ScenarioError(f"{path}: no samples")
    return samples


def render_session(session: Session) -> str:
    """A session as text: its date line (when known), then one ``"{speaker}: {text}"`` line per turn;
    a shared image adds ``" [shares: {blip_caption}]"``."""
    lines = [session.date_time] if session.date_time else []
    for t in session.turns:
        lines.append(f"{t.speaker}: {t.text}" + (f" [shares: {t.blip_caption}]" if t.blip_caption else ""))
    return "\n".join(lines)


def normalize_answer(s: str) -> str:
    """SQuAD v1.1 normalisation: lower case, punctuation removed, articles (a, an, the) removed,
    whitespace collapsed to single spaces."""
    s = "".join(ch for ch in str(s).lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 in [0, 1]: harmonic mean of precision and recall of the multiset of normalised
    tokens; 1.0 when both normalise to nothing, 0.0 when only one does."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = sum((Counter(p) & Counter(g)).values())
    if not common:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def contains(prediction: str, gold: str) -> bool:
    """Normalised containment: the normalised gold's tokens occur as a contiguous run of the normalised
    prediction's tokens (whole tokens: "7" is not in "17"). A gold that normalises to nothing is
    contained only in a prediction that does too."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not g:
        return not p
    return any(p[i:i + len(g)] == g for i in range(len(p) - len(g) + 1))
