"""``injection``: write the other run's downstream notes over a self-consistent cache — does the
decision follow the notes or the field? (docs/design.md §3, §5)

For each token-aligned pair, two injections into prefix caches over ``[0, d)``:

- ``old_notes_into_new``: the new run's cache (new field) with every layer's downstream positions
  ``[b, d)`` overwritten by the old run's KV;
- ``new_notes_into_old``: the old run's cache (old field) with the new run's downstream KV.

The decision token is then fed at ``d`` (it reads the edited cache). The decision *follows the
notes* when the sign of the injected score equals that of the run the notes came from (the notes'
source); otherwise it follows the field (for a flipping pair the two runs' decisions differ, so
exactly one holds). Score-based: ``r_notes = (s_inj - s_base) / (s_source - s_base)``, 1 = the
notes fully decide, 0 = the field fully decides; never clipped.

**Chain of thought** (``scenario.variant=cot``, issue #20; :func:`run_cot`): the same injections,
each decision read after a chain generated greedily from the injected cache (the shared generated
readout, :mod:`kvnotes.kv.generate`; at most ``cot_max_new_tokens`` tokens, on at most
``cot_max_pairs`` aligned pairs round-robin over scenarios, the rest counted ``beyond_max_pairs``).
A pair is screened by its clean chains (old and new in one batch): a clean chain that misses the
answer marker excludes the pair (``old_no_marker`` / ``new_no_marker``); a pair whose old chain
does not name the old candidate and new chain the new one is kept with ``flips = False``
(``no_cot_flip``). The four injected caches decode in one batch. The decision follows the notes
when the injected chain names the notes' source candidate (the owned top-1 after the marker),
follows the field when it names the base run's; an injected chain without its marker is not
scored (``<D>_follows_notes`` None) and counted per direction (``n_unreached``). ``r_notes`` uses
the clean chains' scores after their markers. Rows keep every chain (ids, length, ``marker_at``);
``aggregates.readout`` is ``"generated"``. Check: field + notes reproduces the source run's chain
(``n_field_and_notes_chain_mismatch``) and, where it does, its score.

Follow rates (Wilson CIs) and ``r_notes`` (cluster-bootstrap CIs) are reported only over flipping
pairs (the flip rule, docs/design.md §3); the rest are excluded and counted by reason. As a check, each
direction also injects field + downstream ``[a, d)``, which must reproduce the source run exactly
(``r = 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from collections import Counter

import torch

from kvnotes.records.schema import BaseResult, PairRow
from kvnotes.harness.constraints import Count, NonNegative
from kvnotes.harness.kit import ProbeConfig
from kvnotes.kv import cache as kvcache
from kvnotes.harness import kit as K
from kvnotes.harness.readout import PairRun, first_token_scores, run_pair, variant_scores
from kvnotes.harness.pairs import pair_row
from kvnotes.kv.generate import generate, owned_side, stop_tokens
from tqdm import tqdm
from kvnotes.harness.stats import proportion

DIRECTIONS = {
    # name: (base run = whose field stays, source run = whose notes are written)
    "old_notes_into_new": ("new", "old"),
    "new_notes_into_old": ("old", "new"),
}


#: With ``scenario.variant=cot`` the injected caches' reasoning is generated and the decision read after it.
SUPPORTS_COT = True


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/injection.yaml`` (defaults there; see the module docstring)."""

    #: ``scenario.variant=cot``: most tokens generated per chain, and how many aligned pairs to screen
    cot_max_new_tokens: NonNegative = 40
    cot_max_pairs: Optional[Count] = 12


def injection_masks(n_layers: int, field: tuple[int, int], decision: int) -> dict[str, torch.Tensor]:
    """Patch masks ``[2, n_layers, d]`` of each direction in :data:`DIRECTIONS`, all on the old
    cache with the new run's K/V where true (one batched call scores every variant): row 0 the
    notes, row 1 field + notes, in every layer.

    - ``new_notes_into_old``: ``[b, d)``, then ``[a, d)``;
    - ``old_notes_into_new``: the new cache with the old ``[b, d)`` is the old cache with the new
      K/V everywhere else, ``[0, b)``; with the old ``[a, d)`` it is the old cache with the new
      run's prefix ``[0, a)``.
    """
    a, b = field
    d = decision
    sets = {"new_notes_into_old": [range(b, d), range(a, d)], "old_notes_into_new": [range(0, b), range(0, a)]}
    return {name: kvcache.position_masks(n_layers, d, [list(r) for r in rs]) for name, rs in sets.items()}


@torch.no_grad()
def inject_run(model, run: PairRun, mode: str = "first_token",
               budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> dict:
    """Both injections of one pair's clean run (prefix caches over ``[0, d)``), scored in one
    batched call (:func:`injection_masks`).

    Returns:
        per direction ``D`` in :data:`DIRECTIONS`: ``D_s_notes`` (score with the source's notes),
        ``D_s_all`` (field + notes from the source), ``D_follows_notes`` (sign matches the source
        run), ``D_r_notes`` and ``D_r_all`` (``(s - s_base) / (s_source - s_base)``, None when the
        two runs score equally).
    """
    pair = run.pair
    clean = {"old": run.s_old, "new": run.s_new}
    masks = injection_masks(len(run.old_cache.layers), pair.field, pair.decision)
    scores = variant_scores(model, pair, run.old_cache, run.new_cache, torch.cat([masks[n] for n in DIRECTIONS]),
                            mode, budget_bytes).view(len(DIRECTIONS), 2)
    out = {}
    for (name, (base, source)), s in zip(DIRECTIONS.items(), scores):
        s_notes, s_all = float(s[0]), float(s[1])
        gap = clean[source] - clean[base]
        out |= {
            f"{name}_s_notes": s_notes, f"{name}_s_all": s_all,
            f"{name}_follows_notes": (s_notes > 0) == (clean[source] > 0),
            f"{name}_r_notes": (s_notes - clean[base]) / gap if gap else None,
            f"{name}_r_all": (s_all - clean[base]) / gap if gap else None,
        }
    return out


def inject_pair(model, pair, mode: str = "first_token", budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES,
                min_effect: float = 1.0, flip_rule: str = "owned") -> dict:
    """Clean run of ``pair`` (:func:`kvnotes.harness.readout.run_pair`): its :func:`kvnotes.harness.readout.pair_status`
    columns under ``flip_rule`` and :func:`inject_run`'s columns."""
    run = run_pair(model, pair, mode)
    return run.status(min_effect, flip_rule) | inject_run(model, run, mode, budget_bytes)


def _aggregate(rows: list[dict], n_boot: int, seed: int) -> dict:
    out = {}
    for fam, rs in K.by_family(rows).items():
        out[fam] = {}
        for name in DIRECTIONS:
            follows = sum(bool(r[f"{name}_follows_notes"]) for r in rs)
            out[fam][name] = {
                "follow_notes": proportion(follows, len(rs)),
                "follow_field": proportion(len(rs) - follows, len(rs)),
                "r_notes": K.summary(rs, f"{name}_r_notes", n_boot, seed),
            }
    return out


class InjectionRow(PairRow):
    """A pair: per direction ``<D>_s_notes``, ``<D>_follows_notes``, ``<D>_r_notes``, ..."""

    #: None only under ``scenario.variant=cot``: the injected chain did not reach its marker
    old_notes_into_new_follows_notes: bool | None
    new_notes_into_old_follows_notes: bool | None
    old_notes_into_new_r_notes: float | None
    new_notes_into_old_r_notes: float | None


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[InjectionRow]
    notes: dict[str, str]
    directions: dict[str, dict[str, str]]


# --------------------------------------------------------------------------------------------
# chain of thought (scenario.variant=cot)


def cot_pair(ctx, pair, max_new: int) -> tuple[dict, str | None]:
    """One pair under chain of thought: screened by its clean chains
    (:func:`kvnotes.harness.kit.cot_screen`), then both injections (notes, and field + notes as the
    check) decode their chains in one batch (:func:`kvnotes.kv.generate.generate` on the variant
    caches of :func:`injection_masks`) and each decision is read after its chain's marker.

    Returns:
        (the row: the clean columns and chains, per direction ``D``: ``D_s_notes`` / ``D_s_all``
        (None: marker not reached), ``D_side_notes`` (the candidate the chain names, None when
        neither), ``D_follows_notes`` (None: not reached), ``D_r_notes`` / ``D_r_all``,
        ``D_chain_notes`` / ``D_chain_all``; the exclusion reason when a clean chain missed its
        marker, else None).
    """
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    d = pair.decision
    with ctx.timer("prefill"):
        old_c, new_c = kvcache.prefill(model, pair.old.ids[:d]), kvcache.prefill(model, pair.new.ids[:d])
    row = pair_row(pair)
    screen, why = K.cot_screen(ctx, pair, old_c, new_c, max_new)
    row |= screen
    if why:
        return row, why
    masks = injection_masks(len(old_c.layers), pair.field, d)
    with ctx.timer("injection_generate"):
        gen = generate(model, kvcache.build_variants(model.config, old_c, new_c,
                                                     torch.cat([masks[n] for n in DIRECTIONS])),
                       int(pair.old.ids[d]), d, max_new, K.cot_marker(ctx, pair), stop_tokens(tok))
    clean = {"old": row["s_old"], "new": row["s_new"]}
    for k, (name, (base, source)) in enumerate(DIRECTIONS.items()):
        cols: dict = {}
        for j, what in enumerate(("notes", "all")):
            i = 2 * k + j
            chain = gen.chains[i]
            s = float(first_token_scores(gen.logprobs[i: i + 1], pair)[0]) if chain.reached else None
            gap = clean[source] - clean[base]
            cols |= {f"{name}_s_{what}": s, f"{name}_chain_{what}": chain.record(),
                     f"{name}_r_{what}": (s - clean[base]) / gap if s is not None and gap else None}
            if what == "notes":
                side = owned_side(gen.logprobs[i], pair) if chain.reached else None
                cols |= {f"{name}_side_notes": side,
                         f"{name}_follows_notes": (side == source) if chain.reached else None,
                         f"{name}_unreached_reason": None if chain.reached else K.cot_unreached(ctx, name, chain)}
            else:
                cols[f"{name}_chain_all_matches_source"] = chain.ids == row[f"chain_{source}"]["ids"]
        row |= cols
    return row, None


def _aggregate_cot(rows: list[dict], n_boot: int, seed: int) -> dict:
    """:func:`_aggregate` over generated decisions: follow rates over the injected chains that reached
    their marker (``follow_field`` = the chain names the base run's candidate; a chain naming
    neither counts in ``n`` only), ``n_unreached`` counted apart."""
    out = {}
    for fam, rs in K.by_family(rows).items():
        out[fam] = {}
        for name, (base, _src) in DIRECTIONS.items():
            done = [r for r in rs if r[f"{name}_follows_notes"] is not None]
            follows = sum(bool(r[f"{name}_follows_notes"]) for r in done)
            field = sum(r[f"{name}_side_notes"] == base for r in done)
            out[fam][name] = {
                "follow_notes": proportion(follows, len(done)),
                "follow_field": proportion(field, len(done)),
                "n_neither": len(done) - follows - field,
                "n_unreached": len(rs) - len(done),
                "r_notes": K.summary([r for r in done if r[f"{name}_r_notes"] is not None], f"{name}_r_notes",
                                     n_boot, seed),
            }
    return out


def run_cot(ctx) -> dict:
    """:func:`run` under ``scenario.variant=cot`` (see "Chain of thought" in the module docstring)."""
    cfg = ctx.cfg
    n_boot = int(cfg.n_boot)
    limit = cfg.cot_max_pairs
    pairs, beyond = K.cot_selection(ctx, None if limit is None else int(limit))
    max_new = int(cfg.cot_max_new_tokens)
    rows, screened_out = [], []
    for pair in tqdm(pairs, desc="injection cot", disable=not K.progress(ctx)):
        row, why = cot_pair(ctx, pair, max_new)
        if why:
            screened_out.append(row | {"reason": why})
        else:
            rows.append(row)
    flipping = [r for r in rows if r["flips"]]
    excluded = [{k: r[k] for k in K.EXCLUSION_COLUMNS} | {c: r[c] for c in ("chain_old", "chain_new") if c in r}
                for r in [*ctx.pairs.excluded, *screened_out, *(r for r in rows if not r["flips"])]]
    exclusions = K.exclusion_counts(excluded)
    if beyond:
        exclusions["beyond_max_pairs"] = beyond
    score_err = [abs(r[f"{n}_s_all"] - r[f"s_{src}"]) for r in rows for n, (_, src) in DIRECTIONS.items()
                 if r[f"{n}_s_all"] is not None and r[f"{n}_chain_all_matches_source"]]
    with ctx.timer("statistics"):
        aggregates: dict[str, Any] = {
            "readout": "generated", "max_new_tokens": max_new,
            "n_pairs": len(ctx.pairs.pairs) + len(ctx.pairs.excluded), "n_screened": len(pairs),
            "n_reached": len(rows), "n_flip": len(flipping),
            "n_pairs_by_family": dict(Counter(r["family"] for r in rows)),
            "n_flip_by_family": dict(Counter(r["family"] for r in flipping)),
            "flipping": _aggregate_cot(flipping, n_boot, ctx.seed),
            "checks": {"max_field_and_notes_score_err": max(score_err, default=None),
                       "n_field_and_notes_chain_mismatch": sum(
                           not r[f"{n}_chain_all_matches_source"] for r in rows for n in DIRECTIONS)},
        }
    notes = {f: (f"no generated flips ({n} pairs whose clean chains reached the marker: "
                 f"{dict(Counter(r['reason'] for r in rows if r['family'] == f))}): follow rates are undefined "
                 f"for this family and not reported")
             for f, n in aggregates["n_pairs_by_family"].items() if f not in aggregates["n_flip_by_family"]}
    return {"rows": rows, "aggregates": aggregates, "notes": notes, "exclusions": exclusions, "excluded": excluded,
            "directions": {n: {"base": b, "notes_from": s} for n, (b, s) in DIRECTIONS.items()}}


def run(ctx) -> dict:
    """Inject the other run's notes into every aligned pair; aggregate over flipping pairs.

    Returns:
        ``rows`` (every aligned pair, with ``flips``/``reason``), ``aggregates`` (per family and
        ``all``: per direction follow rates with Wilson CIs and ``r_notes`` with cluster-bootstrap
        CIs, over flipping pairs; the exact-reproduction check over all pairs), ``notes`` (families
        without flipping pairs, with their counts), ``exclusions``
        (reason -> count: tokenisation exclusions and non-flipping pairs), ``excluded``, ``directions``.
    """
    if K.is_cot(ctx):
        return run_cot(ctx)
    cfg = ctx.cfg
    model = ctx.bundle.model
    n_boot = int(cfg.n_boot)
    budget = ctx.budget_bytes
    rows = []
    for run_, row in K.each_pair(ctx, desc="injection"):
        with ctx.timer("injection"):
            rows.append(row | inject_run(model, run_, ctx.readout, budget))
    flipping = [r for r in rows if r["flips"]]
    excluded = K.excluded_rows(ctx.pairs.excluded, rows)
    all_err = [abs(r[f"{n}_r_all"] - 1) for r in rows for n in DIRECTIONS if r[f"{n}_r_all"] is not None]
    score_err = [abs(r[f"{n}_s_all"] - r[f"s_{src}"]) for r in rows for n, (_, src) in DIRECTIONS.items()]
    with ctx.timer("statistics"):
        aggregates: dict[str, Any] = {
            "n_pairs": len(rows), "n_flip": len(flipping),
            "n_pairs_by_family": dict(Counter(r["family"] for r in rows)),
            "n_flip_by_family": dict(Counter(r["family"] for r in flipping)),
            "flipping": _aggregate(flipping, n_boot, ctx.seed),
            "checks": {"max_field_and_notes_score_err": max(score_err, default=None),
                       "max_field_and_notes_recovery_err": max(all_err, default=None)},
        }
    notes = {f: (f"no flipping pairs ({n} aligned pairs: "
                 f"{dict(Counter(r['reason'] for r in rows if r['family'] == f))}): follow rates are undefined "
                 f"for this family and not reported")
             for f, n in aggregates["n_pairs_by_family"].items() if f not in aggregates["n_flip_by_family"]}
    return {"rows": rows, "aggregates": aggregates, "notes": notes,
            "exclusions": K.exclusion_counts(excluded), "excluded": excluded,
            "directions": {n: {"base": b, "notes_from": s} for n, (b, s) in DIRECTIONS.items()}}
