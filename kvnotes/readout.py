"""Decision readout, the flip rule and recovery (DESIGN.md §3).

- score ``s = log p(cand_new) - log p(cand_old)`` at the decision position, from log-softmax in
  fp32 (not raw logits); candidates are tokenised in context. ``mode="first_token"`` (default)
  reads the candidates' first tokens; ``mode="full"`` sums the log-probs of the whole
  continuation, teacher-forced.
- a pair *flips* when the candidate decision (sign of ``s``) differs between the old and new runs
  AND ``|s_new - s_old| >= min_effect`` (nats).
- recovery of an intervention on the old run: ``r = (s_patched - s_old) / (s_new - s_old)``;
  never clipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvnotes import cache as kvcache
from kvnotes.tokens import TokenizedPair

MODES = ("first_token", "full")
NO_DECISION_CHANGE = "no_decision_change"
SMALL_EFFECT = "small_effect"


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"readout mode must be one of {MODES}, got '{mode}'")


@torch.no_grad()
def variant_scores(model, pair: TokenizedPair, base: DynamicCache, source: DynamicCache, masks: torch.Tensor,
                   mode: str = "first_token", budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """Scores of patch variants of the pair's prefix caches.

    Args:
        pair: the token-aligned pair (gives the decision token and candidate ids).
        base, source: prefix caches over positions ``[0, d)`` (usually old and new).
        masks: bool ``[V, n_layers, d]`` patch masks (see :mod:`kvnotes.cache`).

    Returns:
        ``[V]`` fp32 scores ``log p(cand_new) - log p(cand_old)`` in nats.
    """
    _check_mode(mode)
    d_tok = pair.old.ids[pair.decision: pair.decision + 1]
    if mode == "first_token":
        lps = kvcache.patched_logprobs(model, base, source, masks, d_tok, budget_bytes)[:, 0]
        return lps[:, pair.cand_new[0]] - lps[:, pair.cand_old[0]]
    totals = []
    for cand in (pair.cand_old, pair.cand_new):
        tokens = torch.cat([d_tok, torch.tensor(cand[:-1], dtype=torch.long)])
        lps = kvcache.patched_logprobs(model, base, source, masks, tokens, budget_bytes)
        idx = torch.tensor(cand, device=lps.device)
        totals.append(lps.gather(2, idx.view(1, -1, 1).expand(lps.shape[0], -1, 1)).sum(dim=(1, 2)))
    return totals[1] - totals[0]


@dataclass(frozen=True)
class PairRun:
    """The prefix caches and clean scores of a token-aligned pair.

    Attributes:
        old_cache, new_cache: batch-1 prefix caches over ``[0, d)``.
        s_old, s_new: scores of the unpatched old and new runs (nats).
    """

    pair: TokenizedPair
    old_cache: DynamicCache
    new_cache: DynamicCache
    s_old: float
    s_new: float

    @property
    def effect(self) -> float:
        return self.s_new - self.s_old

    def recovery(self, s_patched: torch.Tensor) -> torch.Tensor:
        """``(s_patched - s_old) / (s_new - s_old)``, unclipped."""
        return (s_patched - self.s_old) / self.effect

    def decision_flipped(self, s_patched: torch.Tensor) -> torch.Tensor:
        """Bool: the patched run takes the new run's candidate decision."""
        return (s_patched > 0) == (self.s_new > 0)


@torch.no_grad()
def run_pair(model, pair: TokenizedPair, mode: str = "first_token") -> PairRun:
    """Prefill both prompts of a pair (positions ``[0, d)``) and score the clean runs.

    The clean scores come from the same code path as patched scores (mask none / all), so recovery
    is exactly 0 and 1 for them.
    """
    d = pair.decision
    old_cache = kvcache.prefill(model, pair.old.ids[:d])
    new_cache = kvcache.prefill(model, pair.new.ids[:d])
    masks = torch.zeros(2, len(old_cache.layers), d, dtype=torch.bool)
    masks[1] = True
    s = variant_scores(model, pair, old_cache, new_cache, masks, mode)
    return PairRun(pair, old_cache, new_cache, float(s[0]), float(s[1]))


@torch.no_grad()
def clean_top1(model, run: PairRun) -> tuple[int, int]:
    """The model's own top-1 next token (whole vocabulary) at the decision position of the clean
    old and new runs: tells whether a flip between the two candidates is also the model's answer."""
    d = run.pair.decision
    tok = run.pair.old.ids[d: d + 1]
    out = []
    for c in (run.old_cache, run.new_cache):
        lp = kvcache.continuation_logprobs(model, kvcache.view(c, model.config), tok, d)
        out.append(int(lp[0, -1].argmax()))
    return out[0], out[1]


def flip_status(s_old: float, s_new: float, min_effect: float = 1.0) -> str | None:
    """None when the pair flips, else the exclusion reason.

    Returns:
        ``None`` (flips), ``"no_decision_change"`` (same sign of score in both runs) or
        ``"small_effect"`` (``|s_new - s_old| < min_effect`` nats).
    """
    if (s_old > 0) == (s_new > 0):
        return NO_DECISION_CHANGE
    if abs(s_new - s_old) < min_effect:
        return SMALL_EFFECT
    return None


def pair_status(s_old: float, s_new: float, min_effect: float = 1.0) -> dict:
    """Columns describing a pair's clean decision: ``s_old, s_new, effect, flips, reason,
    correct_direction`` (``reason`` is None for flipping pairs; ``correct_direction`` says the old
    run prefers the old candidate and the new run the new one)."""
    reason = flip_status(s_old, s_new, min_effect)
    return {"s_old": s_old, "s_new": s_new, "effect": s_new - s_old, "flips": reason is None,
            "reason": reason, "correct_direction": s_old < 0 < s_new}


def first_token_score(logprobs: torch.Tensor, pair: TokenizedPair) -> float:
    """First-token score from decision-position log-probs ``[vocab]`` (e.g. of a full forward)."""
    return float(logprobs[pair.cand_new[0]] - logprobs[pair.cand_old[0]])


def screen_pair(model, pair: TokenizedPair, mode: str = "first_token", min_effect: float = 1.0) -> tuple[PairRun, dict]:
    """Run a pair (prefix caches + clean scores) and describe its clean decision.

    Returns:
        (the :class:`PairRun`, :func:`pair_status` columns).
    """
    run = run_pair(model, pair, mode)
    return run, pair_status(run.s_old, run.s_new, min_effect)
