"""What a run found, said when it ends: one summary line, and a warning when no decision flipped.

A record holds every pair and every exclusion, but a user who only reads the terminal should not
have to open it (or run ``kvnotes ownership-scan``) to learn that the probe measured nothing.
:func:`outcome_lines` reads a probe's result and the job's pairs and says: how many pairs were
token-aligned, how many flip under the run's flip rule, and the exclusions by reason (most frequent
first); when none flips, a warning names the top reason with one example in the model's own words
(its top-1 token and probability against the expected candidate, the columns of
:func:`kvnotes.harness.readout.ownership_columns`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvnotes.harness.pairs import pair_meta


def _example(rows: list[dict], reason: str, pairs: Any, tokenizer: Any) -> str:
    """One pair excluded for ``reason``, in words: which clean run answered what instead of its
    expected candidate (``not_owned``), or its effect in nats (the other reasons); ``""`` if no
    excluded row carries the columns."""
    by_id = {pair_meta(p.spec)["pair"]: p for p in getattr(pairs, "pairs", [])}
    for row in rows:
        if row.get("reason") != reason:
            continue
        pair = by_id.get(row.get("pair"))
        if reason == "not_owned" and pair is not None:
            for side, cand in (("old", pair.cand_old), ("new", pair.cand_new)):
                if row.get(f"owns_{side}") is False and row.get(f"top1_id_{side}") is not None:
                    top = tokenizer.decode([int(row[f"top1_id_{side}"])])
                    want = tokenizer.decode([int(cand[0])])
                    return (f"e.g. pair {row['pair']}: the {side} run's top-1 is {top!r} "
                            f"(p={float(row[f'p_top1_{side}']):.3f}), not the expected {want!r}")
        if row.get("effect") is not None:
            return f"e.g. pair {row['pair']}: effect {float(row['effect']):+.3f} nats"
    return ""


def outcome_lines(result: dict, pairs: Any, tokenizer: Any, flip_rule: str) -> list[str]:
    """The lines a job prints about what it found (module docstring).

    Args:
        result: the probe's result (``rows``, ``exclusions``, ``excluded``).
        pairs: the :class:`kvnotes.harness.pairs.PairSet` the probe was given (empty for probes
            that take no pairs: then nothing is said).
        tokenizer: decodes the example's tokens.
        flip_rule: the run's flip rule, named in the line.

    Returns:
        ``["kvnotes: found: ..."]``, plus ``"kvnotes: warning: ..."`` when no pair flips.
    """
    aligned, at_tokens = len(getattr(pairs, "pairs", [])), len(getattr(pairs, "excluded", []))
    if not aligned and not at_tokens:
        return []
    rows = result.get("rows") or []
    excluded = result.get("excluded") or []
    exclusions = {str(k): int(v) for k, v in (result.get("exclusions") or {}).items() if v}
    screened = [r for r in rows if "flips" in r]
    if not exclusions:                       # a probe that reports every pair as a row (screen) counts none
        exclusions = dict(Counter(str(r["reason"]) for r in [*excluded, *screened]
                                  if r.get("flips") is not True and r.get("reason")))
    n_flip = sum(r["flips"] is True for r in screened) if screened else len(rows)
    ranked = sorted(exclusions.items(), key=lambda kv: (-kv[1], kv[0]))
    why = ", ".join(f"{k} {v}" for k, v in ranked) or "none"
    tokens = f" ({at_tokens} more not token-aligned)" if at_tokens else ""
    lines = [f"kvnotes: found: {aligned} token-aligned pairs{tokens}, {n_flip} flip under the {flip_rule} "
             f"rule; excluded by reason: {why}"]
    if n_flip == 0:
        top, count = ranked[0] if ranked else ("none given", 0)
        example = _example(excluded + rows, top, pairs, tokenizer)
        lines.append(f"kvnotes: warning: no decision flipped under the {flip_rule} rule, so the probe's "
                     f"measurements are empty; the top reason is {top} ({count} pairs)"
                     + (f"; {example}" if example else "")
                     + " (kvnotes ownership-scan shows every prompt's top-1)")
    return lines
