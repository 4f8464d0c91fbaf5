"""Scenarios rendered as multi-turn agent transcripts (``scenario.transcript``; issue #37).

The paper's prompts are 770-958-token agent transcripts (a policy, user and assistant turns, tool
calls and their results), and agent contexts in use run to thousands of tokens; the flat layout
(:func:`kvnotes.scenarios.instances.render_user_text`) is about 110. A suite config with
``transcript: {turns: N}`` renders every scenario of the suite as messages instead:

1. ``system``: the scenario's ``system`` text, else an operations-agent policy naming its domain;
2. ``user`` asks for the record, the ``assistant`` calls the ``get_record`` tool, and the ``tool``
   result is JSON whose ``summary`` is the scenario's ``context`` (the field is inside it);
3. the ``assistant`` acknowledges with the instance's filler sentences;
4. ``N`` unrelated exchanges (a user question, a tool call, its JSON result, the answer) about
   ticket counts, disk use, build numbers and the like: numbers and identifiers only, so no word of
   any scenario's field values appears in them;
5. the last ``user`` message holds the rule, the request and the decision prompt, one per line,
   as the flat layout ends; the answer prefix follows as the start of the assistant's turn.

The unrelated exchanges are drawn by a generator seeded from the scenario id and the instance's
index (``crc32``), so an old and a new prompt of one instance differ in the field alone (a polarity
pair's in the trigger alone), and a run is reproducible. Each
exchange is about 120 tokens with a chat template: ``turns`` 6 gives about 900-token prompts (the
paper's), 34 about 4,000 (``conf/scenario/long.yaml``, ``long4k.yaml``).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import numpy as np

from kvnotes.scenarios.instances import Instance, fill_spans, slot_values

#: The system policy of a scenario without its own ``system`` text (``{domain}``: the scenario's domain).
POLICY = ("You are an operations assistant for a team that handles {domain} records. Use the tools to look "
          "things up before you answer, quote tool results exactly, and keep answers short. Never invent a value "
          "that no tool returned. When a policy applies to a request, apply it as written.")

#: The unrelated exchanges: (user question, tool name, the result's keys -> value kinds, answer template).
EXCHANGES = (
    ("How many support tickets are open right now?", "count_open_tickets",
     {"open": "n3", "waiting": "n2", "oldest_days": "n2"}, "There are {open} open tickets, {waiting} waiting on a reply."),
    ("How full is the shared disk?", "disk_usage",
     {"used_gb": "n3", "total_gb": "n4", "volumes": "n1"}, "The shared disk uses {used_gb} of {total_gb} GB."),
    ("Which build do the test servers run?", "latest_build",
     {"build": "id", "commit": "hex", "tests_passed": "n3"}, "The test servers run build {build}, {tests_passed} tests passing."),
    ("What is the exchange rate for the monthly invoices?", "exchange_rate",
     {"rate": "f4", "fetched": "date", "batch": "id"}, "The rate is {rate}, fetched on {fetched}."),
    ("How many rooms are free tomorrow morning?", "room_availability",
     {"free_rooms": "n1", "booked_rooms": "n2", "floor": "n1"}, "{free_rooms} rooms are free on floor {floor}."),
    ("Is the nightly backup finished?", "backup_status",
     {"job": "id", "files": "n5", "duration_min": "n2"}, "Backup job {job} copied {files} files in {duration_min} minutes."),
    ("What was the queue length at noon?", "queue_length",
     {"length": "n3", "sampled": "date", "shard": "n1"}, "At noon the queue held {length} items on shard {shard}."),
    ("How many invoices are still unpaid?", "unpaid_invoices",
     {"count": "n3", "batch": "id", "due_within_days": "n2"}, "{count} invoices in batch {batch} are unpaid."),
)


@dataclass(frozen=True)
class Message:
    """One message of a transcript: its role (``system``, ``user``, ``assistant``, ``tool``) and text."""

    role: str
    content: str


def _draw(kind: str, rng: np.random.Generator) -> str:
    """A value of one kind: ``nK`` a K-digit number, ``f4`` a rate, ``id`` an identifier, ``hex`` a
    commit hash, ``date`` an ISO date."""
    if kind.startswith("n"):
        k = int(kind[1:])
        return str(int(rng.integers(10 ** (k - 1) if k > 1 else 1, 10 ** k)))
    if kind == "f4":
        return f"{rng.uniform(0.5, 2.0):.4f}"
    if kind == "id":
        return f"B-{int(rng.integers(1000, 10000))}"
    if kind == "hex":
        return "".join(rng.choice(list("0123456789abcdef"), 7))
    return f"2025-{int(rng.integers(1, 13)):02d}-{int(rng.integers(1, 29)):02d}"


def _exchange(i: int, rng: np.random.Generator) -> list[Message]:
    """The ``i``-th unrelated exchange (a question from :data:`EXCHANGES`, drawn values)."""
    question, tool, keys, answer = EXCHANGES[int(rng.integers(len(EXCHANGES)))]
    result = {k: _draw(kind, rng) for k, kind in keys.items()}
    call = json.dumps({"tool": tool, "arguments": {"request": f"Q-{i + 1:03d}"}})
    return [Message("user", question), Message("assistant", call),
            Message("tool", json.dumps({"tool": tool, "result": result})), Message("assistant", answer.format(**result))]


#: Where :func:`render_transcript` puts a notice (an erratum): a line of the last user message before
#: the request or before the decision prompt, or a line of the record's tool result after its summary.
NOTICE_PLACEMENTS = ("before_request", "before_decision", "after_context")


def render_transcript(instance: Instance, value: str, variant: str = "direct", turns: int = 6,
                      notice: str | None = None, placement: str = "before_request",
                      hoist: bool = False) -> tuple[list[Message], dict[str, list[tuple[int, int, int]]], str]:
    """The transcript of ``instance`` with the field set to ``value`` (see the module docstring).

    Args:
        notice: a line inserted at ``placement`` (:data:`NOTICE_PLACEMENTS`; the erratum of
            :mod:`kvnotes.harness.edit_prompts`), or None.
        hoist: the restructuring baseline of the edit probe: the record's exchange (request, tool
            call, result, acknowledgement) comes after the unrelated exchanges, just before the last
            user message, instead of before them (the flat layout's hoisted order moves the context
            line to just before the request); the unrelated exchanges are the same.

    Returns:
        (messages, slot name -> ``(message index, start, end)`` character spans of that slot's value
        inside the message's content, in order of appearance, answer prefix).

    Raises:
        ValueError: an unknown placement.
    """
    if placement not in NOTICE_PLACEMENTS:
        raise ValueError(f"unknown notice placement '{placement}' (known: {', '.join(NOTICE_PLACEMENTS)})")
    if notice is not None:                          # literal text: no slot of it is filled or located
        notice = notice.replace("{", "{{").replace("}", "}}")
    sc = instance.scenario
    values = slot_values(instance, value)
    var = sc.variants[variant]
    # seeded by the instance, not its polarity: a polarity pair's two prompts differ in the trigger alone
    rng = np.random.default_rng(zlib.crc32(f"{sc.id}/{instance.index}".encode()))
    spans: dict[str, list[tuple[int, int, int]]] = {}

    def message(role: str, pieces: list[str], head: str = "", tail: str = "") -> Message:
        """A message of ``pieces`` (slots filled, one per line) between ``head`` and ``tail``; the
        slots' spans are recorded under the message's index."""
        lines, offset = [], len(head)
        for piece in pieces:
            text, found = fill_spans(piece, values)
            for name, where in found.items():
                spans.setdefault(name, []).extend((len(messages), offset + s, offset + e) for s, e in where)
            lines.append(text)
            offset += len(text) + 1
        return Message(role, head + "\n".join(lines) + tail)

    def record() -> None:
        messages.append(Message("user", f"Please pull up the {sc.domain} record for this request."))
        messages.append(Message("assistant", json.dumps({"tool": "get_record", "arguments": {"request": "Q-000"}})))
        summary = [sc.context] + ([notice] if notice is not None and placement == "after_context" else [])
        messages.append(message("tool", summary, '{"tool": "get_record", "result": {"summary": "', '"}}'))
        messages.append(Message("assistant", "I have the record. " + " ".join(instance.filler)))

    messages: list[Message] = []
    messages.append(message("system", [sc.system or POLICY.format(domain=sc.domain)]))
    if not hoist:
        record()
    for i in range(turns):
        messages.extend(_exchange(i, rng))
    if hoist:
        record()
    last = {"rule": sc.rule, "request": sc.request, "decision": var.decision}
    names = list(last)
    if notice is not None and placement != "after_context":
        names.insert(names.index(placement.removeprefix("before_")), "notice")
        last["notice"] = notice
    messages.append(message("user", [last[n] for n in names if last[n]]))
    return messages, spans, var.answer_prefix
