"""The inputs of an agent trajectory (``docs/probes/agent.md``): the field values of its turns, the
user message of a later turn (a state update, then the request), and on a transcript suite the
conversation so far. What :mod:`kvnotes.harness.pairs` is to the pair probes, this is to ``agent``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvnotes.harness.edit_prompts import erratum_text, user_pieces
from kvnotes.harness.selection import pair_rng
from kvnotes.harness.tokens import Prompt
from kvnotes.scenarios.instances import Instance


def trajectory_values(instance: Instance, turns: int, seed: int) -> list[str]:
    """``turns`` field values of the instance's scenario: the first drawn at random, each next one
    drawn among the values other than the previous (a ``numpy`` generator seeded by the run seed
    and the instance id, :func:`kvnotes.harness.selection.pair_rng`)."""
    values = list(instance.scenario.values)
    rng = pair_rng(seed, instance.id)
    out = [values[int(rng.integers(len(values)))]]
    for _ in range(turns - 1):
        others = [v for v in values if v != out[-1]]
        out.append(others[int(rng.integers(len(others)))])
    return out


def update_text(instance: Instance, value: str, variant: str) -> str:
    """The user message of a later turn: the state update for ``value``, then the request and
    decision lines of the scenario."""
    pieces, _, _ = user_pieces(instance, value, variant)
    return "\n".join(p for p in (erratum_text(instance, value), pieces["request"], pieces["decision"]) if p)


def transcript_conversation(tok, instance: Instance, value: str, variant: str, layout_turns: int,
                            users: Sequence[str], answers: Sequence[str], chat: bool, template_kwargs: dict) -> Prompt:
    """The conversation of a trajectory on a transcript suite: the transcript of ``instance`` with the
    field set to ``value`` (:func:`kvnotes.scenarios.transcript.render_transcript`, ``layout_turns``
    unrelated exchanges), then for each of ``answers`` the assistant's answer (after the answer
    prefix) and the next user message of ``users`` (``users[0]`` is the transcript's own last user
    message and is not repeated), ending at the answer prefix. The field is the transcript's.

    A later turn only appends to the earlier ones: with a chat template the answer closes the
    assistant's turn; in the plain rendering (a tokenizer without a template), which ends each
    prompt at the bare answer prefix, the answer follows that prefix and the next message is a
    ``User:`` line, as :func:`kvnotes.models.text.render_messages` writes messages."""
    from kvnotes.harness.tokens import prompt_at
    from kvnotes.models.text import render_messages, rendering
    from kvnotes.scenarios.transcript import Message, render_transcript

    messages, where, prefix = render_transcript(instance, value, variant, layout_turns)
    later = list(zip(answers, users[1:], strict=True))
    if rendering(tok, chat) == "chat_template":
        for answer, user in later:
            messages += [Message("assistant", prefix + answer), Message("user", user)]
        text, starts = render_messages(tok, messages, prefix, chat, template_kwargs)
    else:
        text, starts = render_messages(tok, messages, prefix, chat, template_kwargs)
        text += "".join(f"{answer}\nUser: {user}\n{prefix}" for answer, user in later)
    ((m, a, b),) = where[instance.scenario.field_slot]
    return prompt_at(tok, text, (starts[m] + a, starts[m] + b))
