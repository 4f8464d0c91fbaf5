"""The decision at the decision position and whether it is the model's own (``docs/design.md``,
"Decision ownership"): one :class:`Decision` type for the harness's clean runs of a pair
(:func:`clean_decisions`, :mod:`kvnotes.harness.readout`) and for the editable context's candidate
readout (:meth:`kvnotes.context.EditableContext.decide`), and :func:`verdict`, the editable context's
rule comparing an in-place edit's decision with a corrected arm's. Imports nothing from the harness."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvnotes.errors import KvnotesError

#: The rules of :func:`verdict`.
RULES = ("flip", "extrapolate")
#: Default margin (nats) of :func:`verdict` and :meth:`kvnotes.context.EditableContext.diagnose`: the
#: corrected decision must lead the in-place one by at least this much in log-probability before an
#: erratum is called for.
DEFAULT_MARGIN = 0.0


@dataclass(frozen=True)
class Decision:
    """What one run decides at the decision position, and whether that decision *owns* it: the
    model's top-1 token over the whole vocabulary is the first token of the candidate the decision
    names (only owned decisions count as the model's own).

    Two readouts fill it:

    - a clean run of a token-aligned pair (:func:`clean_decisions`): ``top1`` is the vocabulary top-1
      token id, ``expected`` the first token id of the candidate the run is expected to answer,
      ``p_top1`` and ``cand_mass`` probabilities; ``owns`` is derived, ``top1 == expected``;
    - a candidate readout (:meth:`kvnotes.context.EditableContext.decide`): ``candidates`` and their
      ``scores``, ``top1`` the best-scoring candidate's text, ``owns`` given by the reader (the
      vocabulary top-1 is that candidate's first token) and the ``logprobs`` it was read from.

    Attributes:
        candidates: the candidate continuations, as given (candidate readout; else empty).
        scores: fp32 ``[n]`` log-probabilities (nats) of each candidate's first token in context.
        top1: the decision: the vocabulary top-1 token id (clean run) or the best candidate (text).
        owns: whether the decision is the model's own; when not given, ``top1 == expected``.
        logprobs: fp32 ``[vocab]`` next-token log-probs at the decision position.
        p_top1: the probability of the vocabulary top-1 token (clean run).
        expected: the first token id of the candidate this run is expected to answer (clean run).
        cand_mass: total probability of the two candidates' first tokens (clean run).

    Raises:
        ValueError: no ``top1``, or neither ``owns`` nor ``expected``.
    """

    candidates: tuple[str, ...] = ()
    scores: torch.Tensor | None = None
    top1: int | str | None = None
    owns: bool | None = None
    logprobs: torch.Tensor | None = None
    p_top1: float | None = None
    expected: int | None = None
    cand_mass: float | None = None

    def __post_init__(self) -> None:
        if self.top1 is None:
            raise ValueError("a Decision needs its top1")
        if self.owns is None:
            if self.expected is None:
                raise ValueError("a Decision needs owns, or the expected token to derive it from")
            object.__setattr__(self, "owns", self.top1 == self.expected)

    @property
    def owned(self) -> bool:
        """Alias of :attr:`owns` (the name :mod:`kvnotes.context` documents)."""
        return bool(self.owns)


def clean_decisions(logprobs: torch.Tensor, pair) -> tuple[Decision, Decision]:
    """The old and new runs' :class:`Decision` from decision-position log-probs ``[2, vocab]``
    (row 0 the old run, row 1 the new run; fp32 log-softmax).

    Args:
        pair: a token-aligned pair (:class:`kvnotes.harness.tokens.TokenizedPair`; only
            ``cand_old[0]`` and ``cand_new[0]`` are read).
    """
    p = logprobs.float().exp()
    cands = [pair.cand_old[0], pair.cand_new[0]]
    out = []
    for i, expected in enumerate(cands):
        top = int(p[i].argmax())
        out.append(Decision(top1=top, p_top1=float(p[i, top]), expected=expected, cand_mass=float(p[i, cands].sum())))
    return out[0], out[1]


def verdict(in_place: Decision, corrected: Decision, rule: str = "flip", margin: float = DEFAULT_MARGIN,
            share: float = 1.0) -> tuple[bool, str]:
    """Whether the in-place edit does not suffice, from its decision and a corrected arm's.

    - ``flip``: the corrected decision is owned, names another candidate than the in-place one and
      leads it by more than ``margin`` nats in the corrected distribution.
    - ``extrapolate``: the corrected arm recomputed a ``share`` (in (0, 1]) of the downstream
      positions; each other candidate's log-odds against the in-place decision is extrapolated
      linearly to a full recompute, ``lo_in_place + (lo_corrected - lo_in_place) / share``, and the
      edit needs more when the best of them exceeds ``margin`` nats. A partial recompute of the
      most-deviating positions moves the decision only part of the way; the extrapolation asks
      where the whole way would end (``docs/context.md`` measures both rules).

    Returns:
        ``(needs more, one-line reason)``.

    Raises:
        KvnotesError: an unknown rule, a share outside (0, 1], or a decision without candidate scores.
    """
    if rule not in RULES:
        raise KvnotesError(f"unknown diagnostic rule {rule!r}; choose one of {', '.join(RULES)}")
    if not 0 < share <= 1:
        raise KvnotesError(f"the corrected arm's share of downstream positions must be in (0, 1], got {share}")
    s_ip, s_c = in_place.scores, corrected.scores
    if s_ip is None or s_c is None:
        raise KvnotesError("verdict compares candidate readouts (decisions with candidate scores)")
    ip = in_place.candidates.index(in_place.top1)
    if rule == "flip":
        gap = float(s_c[corrected.candidates.index(corrected.top1)] - s_c[ip])
        if corrected.top1 == in_place.top1:
            return False, f"keeps the in-place decision {in_place.top1!r}"
        if not corrected.owned:
            return False, f"the corrected decision {corrected.top1!r} is not the model's top-1 token"
        if gap <= margin:
            return False, f"prefers {corrected.top1!r} by {gap:.3f} nats <= margin {margin}"
        return True, f"moves the decision {in_place.top1!r} -> {corrected.top1!r} by {gap:.3f} nats"
    lo_ip = s_ip - s_ip[ip]
    lo_c = s_c - s_c[ip]
    full = lo_ip + (lo_c - lo_ip) / share
    full[ip] = -float("inf")
    best = int(full.argmax())
    if float(full[best]) <= margin:
        return False, f"extrapolated log-odds of {in_place.candidates[best]!r} {float(full[best]):.3f} <= margin {margin}"
    return True, (f"extrapolated log-odds of {in_place.candidates[best]!r} over {in_place.top1!r} "
                  f"{float(full[best]):.3f} > margin {margin}")


def kl_nats(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats of log-probability vectors: ``sum p (log p - log q)`` over the last axis.
    The one KL of the harness: a composed, edited or memory arm against the full prefill (``p``,
    the reference), a patched run against the clean one.

    Args:
        p_log: fp32 log-probs ``[..., vocab]`` (log-softmax outputs) of the reference.
        q_log: the same of the compared distribution, same shape.

    Returns:
        ``[...]`` nats (0 when the distributions are equal; float rounding can leave it at -1e-7).
    """
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def recovery(s, s_old: float, s_new: float):
    """Recovery of an intervened run's score: ``(s - s_old) / (s_new - s_old)``, unclipped
    (docs/design.md §3; the paper's "recovery"): 0 where the run decides like the old (corrupted)
    run, 1 where like the new (clean) one. The one recovery of the harness.

    Args:
        s: the intervened run's score ``log p(new) - log p(old)`` (nats): a float, a tensor of
            scores, or None (a chain that missed its marker).
        s_old: the old (corrupted) run's score (nats).
        s_new: the new (clean) run's score (nats).

    Returns:
        like ``s``; None where ``s`` is None, or a float ``s`` whose clean runs score alike.
    """
    if s is None:
        return None
    gap = s_new - s_old
    if isinstance(s, torch.Tensor):
        return (s - s_old) / gap
    return (s - s_old) / gap if gap else None
