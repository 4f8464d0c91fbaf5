"""Decision readout, the flip rule and recovery (docs/design.md §3).

- score ``s = log p(cand_new) - log p(cand_old)`` at the decision position, from log-softmax in
  fp32 (not raw logits); candidates are tokenised in context. ``mode="first_token"`` (default)
  reads the candidates' first tokens; ``mode="full"`` sums the log-probs of the whole
  continuation, teacher-forced.
- a pair *flips* under the ``relative`` rule when the candidate decision (sign of ``s``) differs
  between the old and new runs AND ``|s_new - s_old| >= min_effect`` (nats); under the ``owned``
  rule (the default) each clean run's vocabulary top-1 token must in addition be its expected
  candidate's first token, so the flip is the model's own answer and not a shift between two
  candidates it does not say (``docs/design.md``, "Decision ownership").
- recovery of an intervention on the old run: ``r = (s_patched - s_old) / (s_new - s_old)``;
  never clipped.

Each clean run's vocabulary decision is a :class:`kvnotes.kv.decision.Decision`
(:func:`kvnotes.kv.decision.clean_decisions`; the one decision type, which :mod:`kvnotes.context`
reads candidates into too), re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from transformers import DynamicCache

from kvnotes.kv import cache as kvcache
from kvnotes.kv.masks import Masks
from kvnotes.kv import patch as kvpatch
from kvnotes.kv.decision import Decision as Decision, clean_decisions as clean_decisions, recovery
from kvnotes.harness.tokens import TokenizedPair

ReadoutMode = Literal["first_token", "full"]
READOUT_MODES: tuple[str, ...] = get_args(ReadoutMode)
#: Flip rules: ``owned`` (top-1 answers + margin), ``relative`` (candidate sign change + margin) and
#: ``synthetic`` (the margin alone, for random-weight models only: they decide nothing, so the
#: conformance lane needs pairs whose score moves; records name the rule).
FlipRule = Literal["owned", "relative", "synthetic"]
FLIP_RULES: tuple[str, ...] = get_args(FlipRule)
NO_DECISION_CHANGE = "no_decision_change"
SMALL_EFFECT = "small_effect"
NOT_OWNED = "not_owned"


def _check_mode(mode: str) -> None:
    if mode not in READOUT_MODES:
        raise ValueError(f"readout mode must be one of {READOUT_MODES}, got '{mode}'")


def first_token_scores(logprobs: torch.Tensor, pair: TokenizedPair) -> torch.Tensor:
    """First-token logit differences ``log p(cand_new[0]) - log p(cand_old[0])`` (nats) from
    decision-position log-probs ``[V, vocab]`` (fp32 log-softmax). Returns ``[V]``."""
    return logprobs[:, pair.cand_new[0]] - logprobs[:, pair.cand_old[0]]


def candidate_scores(forward, pair: TokenizedPair, mode: ReadoutMode = "first_token"):
    """The one scoring path of the project: the score ``s`` of every variant of a forward.

    Args:
        forward: ``forward(tokens, first) -> (logprobs, extra)``: feeds ``tokens`` (``[n]``: the
            decision token, then any teacher-forced continuation) at the decision position of every
            variant and returns fp32 log-probs ``[V, n, vocab]`` and anything else the caller
            wants back; ``first`` is True for the first call of this scoring.
        mode: ``first_token`` (the candidates' first tokens) or ``full`` (sum of the log-probs of
            each candidate's whole continuation, teacher-forced; one forward per candidate).

    Returns:
        (``[V]`` scores in nats, ``extra`` of the first forward).

    Raises:
        ValueError: unknown mode.
    """
    _check_mode(mode)
    d_tok = pair.old.ids[pair.decision: pair.decision + 1]
    if mode == "first_token":
        lps, extra = forward(d_tok, True)
        return first_token_scores(lps[:, 0], pair), extra
    totals, first = [], None
    for i, cand in enumerate((pair.cand_old, pair.cand_new)):
        tokens = torch.cat([d_tok, torch.tensor(cand[:-1], dtype=torch.long)])
        lps, extra = forward(tokens, i == 0)
        first = extra if i == 0 else first
        idx = torch.tensor(cand, device=lps.device)
        totals.append(lps.gather(2, idx.view(1, -1, 1).expand(lps.shape[0], -1, 1)).sum(dim=(1, 2)))
    return totals[1] - totals[0], first


@torch.no_grad()
def variant_scores(model, pair: TokenizedPair, base: DynamicCache, source: DynamicCache, masks: Masks,
                   mode: ReadoutMode = "first_token", budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """Scores of patch variants of the pair's prefix caches.

    ``first_token``: the logit difference of the candidates' first tokens, from their two logits
    only (:func:`kvnotes.kv.patch.patched_logits` with ``vocab_ids``; the log-softmax normaliser
    cancels in ``log p(a) - log p(b)``, so no vocabulary-wide unembedding is computed). ``full``:
    :func:`candidate_scores` over :func:`kvnotes.kv.patch.patched_logprobs`.

    Args:
        pair: the token-aligned pair (gives the decision token and candidate ids).
        base: prefix caches over positions ``[0, d)`` (usually old and new).
        source: prefix caches over positions ``[0, d)`` (usually old and new).
        masks: bool ``[V, n_layers, d]`` patch masks, dense or factored (:mod:`kvnotes.kv.masks`).

    Returns:
        ``[V]`` fp32 scores ``log p(cand_new) - log p(cand_old)`` in nats.
    """
    _check_mode(mode)
    if mode == "first_token":
        d = pair.decision
        logits = kvpatch.patched_logits(model, base, source, masks, pair.old.ids[d: d + 1], budget_bytes,
                                        vocab_ids=[pair.cand_old[0], pair.cand_new[0]])[:, 0]
        return logits[:, 1] - logits[:, 0]
    return candidate_scores(
        lambda tokens, _: (kvpatch.patched_logprobs(model, base, source, masks, tokens, budget_bytes), None),
        pair, mode)[0]


def ownership_columns(decisions: tuple[Decision, Decision]) -> dict:
    """Row columns of the two clean runs' :class:`Decision`: ``top1_id_<run>``, ``p_top1_<run>``,
    ``cand_mass_<run>``, ``owns_<run>`` and ``owned`` (both runs answer their expected candidate)."""
    out = {}
    for name, dec in zip(("old", "new"), decisions):
        out |= {f"top1_id_{name}": dec.top1, f"p_top1_{name}": dec.p_top1, f"cand_mass_{name}": dec.cand_mass,
                f"owns_{name}": dec.owns}
    return out | {"owned": all(d.owns for d in decisions)}


@dataclass(frozen=True)
class PairRun:
    """The prefix caches and clean scores of a token-aligned pair.

    Attributes:
        old_cache, new_cache: batch-1 prefix caches over ``[0, d)``.
        s_old, s_new: scores of the unpatched old and new runs (nats).
        decisions: the clean runs' vocabulary decisions (old, new), for the ``owned`` flip rule.
    """

    pair: TokenizedPair
    old_cache: DynamicCache
    new_cache: DynamicCache
    s_old: float
    s_new: float
    decisions: tuple[Decision, Decision] | None = None

    @property
    def effect(self) -> float:
        return self.s_new - self.s_old

    def recovery(self, s_patched: torch.Tensor) -> torch.Tensor:
        """``(s_patched - s_old) / (s_new - s_old)``, unclipped (:func:`kvnotes.kv.decision.recovery`)."""
        return recovery(s_patched, self.s_old, self.s_new)

    def decision_flipped(self, s_patched: torch.Tensor) -> torch.Tensor:
        """Bool: the patched run takes the new run's candidate decision."""
        return (s_patched > 0) == (self.s_new > 0)

    def status(self, min_effect: float = 1.0, flip_rule: FlipRule = "owned") -> dict:
        """:func:`pair_status` columns of this run (with ownership columns when known)."""
        return pair_status(self.s_old, self.s_new, min_effect, flip_rule, self.decisions)

    def with_caches(self, model) -> "PairRun":
        """This run with its prefix caches, prefilled again if they were released (a probe that
        must see every pair before it can process one keeps only scores in between)."""
        if self.old_cache is not None:
            return self
        d = self.pair.decision
        return PairRun(self.pair, kvcache.prefill(model, self.pair.old.ids[:d]),
                       kvcache.prefill(model, self.pair.new.ids[:d]), self.s_old, self.s_new, self.decisions)

    def released(self) -> "PairRun":
        """The run without its prefix caches (frees memory; scores and decisions kept)."""
        return PairRun(self.pair, None, None, self.s_old, self.s_new, self.decisions)


@torch.no_grad()
def run_pair(model, pair: TokenizedPair, mode: ReadoutMode = "first_token", prefill=None) -> PairRun:
    """Prefill both prompts of a pair (positions ``[0, d)``) and score the clean runs.

    The clean scores come from the same code path as patched scores (mask none / all), so recovery
    is exactly 0 and 1 for them; the same forward gives each run's vocabulary decision
    (:class:`Decision`).

    Args:
        prefill: ``(model, ids) -> cache`` (default :func:`kvnotes.kv.cache.prefill`); a job's
            :class:`kvnotes.harness.kit.CleanRuns` passes its memo of prompts already prefilled.
    """
    _check_mode(mode)
    d = pair.decision
    prefill = prefill or kvcache.prefill
    old_cache = prefill(model, pair.old.ids[:d])
    new_cache = prefill(model, pair.new.ids[:d])
    masks = torch.zeros(2, len(old_cache.layers), d, dtype=torch.bool)
    masks[1] = True
    lps = kvpatch.patched_logprobs(model, old_cache, new_cache, masks, pair.old.ids[d: d + 1])[:, 0]
    if mode == "first_token":
        s = first_token_scores(lps, pair)
    else:
        s = variant_scores(model, pair, old_cache, new_cache, masks, mode)
    return PairRun(pair, old_cache, new_cache, float(s[0]), float(s[1]), clean_decisions(lps, pair))


def check_flip_rule(flip_rule: str, random_weights: bool, model_name: str) -> None:
    """Refuse ``flip_rule=synthetic`` for a model with trained weights (it counts flips on
    random-weight models only: the conformance lane).

    Raises:
        KvnotesError: one line naming the model and the rules to use.
    """
    from kvnotes.errors import KvnotesError

    if flip_rule == "synthetic" and not random_weights:
        raise KvnotesError(f"flip_rule=synthetic counts flips on random-weight models only "
                           f"(model.random_init.enabled=true); model '{model_name}' is a checkpoint: "
                           f"use owned or relative")


def flip_status(s_old: float, s_new: float, min_effect: float = 1.0) -> str | None:
    """None when the pair flips under the ``relative`` rule, else the exclusion reason.

    Returns:
        ``None`` (flips), ``"no_decision_change"`` (same sign of score in both runs) or
        ``"small_effect"`` (``|s_new - s_old| < min_effect`` nats).
    """
    if (s_old > 0) == (s_new > 0):
        return NO_DECISION_CHANGE
    if abs(s_new - s_old) < min_effect:
        return SMALL_EFFECT
    return None


def pair_status(s_old: float, s_new: float, min_effect: float = 1.0, flip_rule: FlipRule = "owned",
                decisions: tuple[Decision, Decision] | None = None) -> dict:
    """Columns describing a pair's clean decision under a flip rule.

    Columns: ``s_old, s_new, effect``; ``flips_relative`` (candidate sign change with
    ``|effect| >= min_effect``); ``flips_owned`` (that, and each clean run's vocabulary top-1 is its
    expected candidate's first token; None without ``decisions``); ``flip_rule``; ``flips`` (the
    configured rule); ``reason`` (None for flipping pairs, else ``no_decision_change``,
    ``small_effect`` or ``not_owned``; under ``synthetic`` a pair flips when ``|effect| >= min_effect``,
    whatever the signs: a rule for random-weight models only); ``correct_direction`` (the old run prefers the old
    candidate and the new run the new one); and the :func:`ownership_columns` when ``decisions``
    are given.

    Raises:
        ValueError: unknown ``flip_rule``, or ``owned`` without ``decisions``.
    """
    if flip_rule not in FLIP_RULES:
        raise ValueError(f"flip_rule must be one of {FLIP_RULES}, got '{flip_rule}'")
    if flip_rule == "owned" and decisions is None:
        raise ValueError("the owned flip rule needs the clean runs' vocabulary decisions")
    relative = flip_status(s_old, s_new, min_effect)
    owned = None if decisions is None else relative is None and all(d.owns for d in decisions)
    reason = relative
    if reason is None and flip_rule == "owned" and not owned:
        reason = NOT_OWNED
    if flip_rule == "synthetic":
        reason = None if abs(s_new - s_old) >= min_effect else SMALL_EFFECT
    out = {"s_old": s_old, "s_new": s_new, "effect": s_new - s_old, "flips_relative": relative is None,
           "flips_owned": owned, "flip_rule": flip_rule, "flips": reason is None, "reason": reason,
           "correct_direction": s_old < 0 < s_new}
    return out | (ownership_columns(decisions) if decisions is not None else {})


def first_token_score(logprobs: torch.Tensor, pair: TokenizedPair) -> float:
    """First-token score from decision-position log-probs ``[vocab]`` (e.g. of a full forward)."""
    return float(first_token_scores(logprobs[None], pair)[0])


def screen_pair(model, pair: TokenizedPair, mode: ReadoutMode = "first_token", min_effect: float = 1.0,
                flip_rule: FlipRule = "owned") -> tuple[PairRun, dict]:
    """Run a pair (prefix caches + clean scores + vocabulary decisions) and describe its clean
    decision under ``flip_rule``.

    Returns:
        (the :class:`PairRun`, :func:`pair_status` columns).
    """
    run = run_pair(model, pair, mode)
    return run, run.status(min_effect, flip_rule)


def collapse_flags(lp: torch.Tensor, cands: tuple[int, int], drop_nats: float, top_k: int) -> dict[str, torch.Tensor]:
    """Readout-destroyed criterion per variant against variant 0 (the clean, nothing-knocked run).

    Args:
        lp: fp32 ``[V, vocab]`` first-token log-probs at the decision position; row 0 is clean.
        cands: first tokens of the two candidates.
        drop_nats: both candidates must fall by at least this much (nats) for ``drop``.
        top_k: ``topk_lost`` when neither candidate is in the top-k but one was in the clean top-k.

    Returns:
        bool ``[V]`` tensors ``drop``, ``topk_lost``, ``collapsed`` (either).
    """
    c = torch.tensor(cands, device=lp.device)
    cl = lp[:, c]                                                  # [V, 2]
    drop = ((cl[0:1] - cl) >= drop_nats).all(dim=1)
    kth = lp.topk(min(top_k, lp.shape[1]), dim=1).values[:, -1:]   # [V, 1]
    in_top = (cl >= kth).any(dim=1)
    lost = in_top[0] & ~in_top
    return {"drop": drop, "topk_lost": lost, "collapsed": drop | lost}
