"""``screen``: which pairs flip, per model, family and scenario, under both flip rules.

Specification: ``docs/probes/screen.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvnotes.harness import kit as K
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.stats import proportion, summarize_rows
from kvnotes.harness.tokens import token_name
from kvnotes.records.figures import Bars
from kvnotes.records.presentation import Presentation, ResultsColumn
from kvnotes.records.schema import BaseResult, PairRow, Summary, TypedDict
from kvnotes.records.tables import Lines, fmt_counts


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/screen.yaml`` (the defaults are here; the YAML sets what differs; see the specification)."""

    pass


def table(rows: list[dict], excluded: list[dict], key: str) -> dict:
    """Counts per value of ``key``: pairs, flips, expected flips, unexpected flips, exclusions."""
    out = {}
    for g in sorted({r[key] for r in rows} | {r[key] for r in excluded}):
        rs = [r for r in rows if r[key] == g]
        ex = [r for r in excluded if r[key] == g]
        flips = [r for r in rs if r["flips"]]
        expected = [r for r in rs if r["expect_flip"]]
        out[g] = {
            "n_pairs": len(rs),
            "n_flip": len(flips),
            "flip_rate": proportion(len(flips), len(rs)),
            "n_flip_relative": sum(r["flips_relative"] for r in rs),
            "n_flip_owned": sum(bool(r["flips_owned"]) for r in rs),
            "n_expected_flip": len(expected),
            "n_flip_when_expected": sum(r["flips"] for r in expected),
            "owned_when_expected": proportion(sum(bool(r["flips_owned"]) for r in expected), len(expected)),
            "unexpected_flips": sum(r["flips"] and not r["expect_flip"] for r in rs),
            "n_correct_direction": sum(r["flips"] and r["correct_direction"] for r in rs),
            "n_scenarios": len({r["scenario"] for r in rs}),
            "excluded": K.exclusion_counts(ex),
            "not_flipping": K.exclusion_counts([r for r in rs if not r["flips"]]),
        }
    return out


class ScreenRow(PairRow):
    """A screened pair: clean status under both flip rules and each run's top-1 token."""

    flips_relative: bool
    flips_owned: bool | None
    expect_flip: bool
    top1_old: str
    top1_new: str


class ScreenAggregates(TypedDict):
    by_family: dict[str, dict[str, Any]]
    by_scenario: dict[str, dict[str, Any]]
    n_pairs: int
    n_flip: int
    flip_rule: str
    effect_flipping: dict[str, Summary]


class Result(BaseResult):
    """What ``run`` returns (record ``result``)."""

    rows: list[ScreenRow]
    aggregates: ScreenAggregates


def run(ctx) -> dict:
    """Screen every pair; see the specification."""
    tok = ctx.bundle.tokenizer
    rows = [row | {"top1_old": token_name(tok, row["top1_id_old"]), "top1_new": token_name(tok, row["top1_id_new"])}
            for _, row in K.each_pair(ctx, desc="screen")]
    excluded = ctx.pairs.excluded
    flipping = [r for r in rows if r["flips"]]
    return {
        "rows": rows,
        "exclusions": ctx.pairs.exclusion_counts(),
        "excluded": excluded,
        "aggregates": {
            "by_family": table(rows, excluded, "family"),
            "by_scenario": table(rows, excluded, "scenario"),
            "n_pairs": len(rows),
            "n_flip": len(flipping),
            "flip_rule": ctx.flip_rule,
            "n_flip_relative": sum(r["flips_relative"] for r in rows),
            "n_flip_owned": sum(bool(r["flips_owned"]) for r in rows),
            "flip_families": sorted({r["family"] for r in flipping}),
            "effect_flipping": summarize_rows(flipping, "effect", seed=ctx.seed),
        },
    }


def flip_count(rec: dict) -> tuple[str, str] | None:
    """The headline of a screen: flipping pairs of all aligned pairs (None without the counts)."""
    aggs = rec["result"].get("aggregates", {})
    if "n_flip" not in aggs or "n_pairs" not in aggs:
        return None
    return "flipping pairs", f"{aggs['n_flip']} of {aggs['n_pairs']} ({rec['config'].get('flip_rule')} rule)"


# ---------------------------------------------------------------------------------------------
# presentation


def _screen_pairs(rec: dict, fam: str) -> str:
    a = rec["result"]["aggregates"]
    t = a if fam == "all" else a["by_family"].get(fam)
    return f"{t['n_flip']}/{t['n_pairs']}" if t else "-"


def screen_table(rec: dict, by: str = "family") -> str:
    """The per-family (``by="family"``) or per-scenario screen table of a ``screen`` record."""
    w = Lines()
    table = rec["result"]["aggregates"][f"by_{by}"]
    w(f"Model `{rec['model']['name']}`, scenario `{rec['scenario']['name']}` "
      f"({rec['config']['scenario']['n_instances']} instances per scenario, seed {rec['config']['scenario']['seed']}), "
      f"readout `{rec['config']['readout']}`, flip rule `{rec['config'].get('flip_rule', 'relative')}`, "
      f"min_effect {rec['config']['min_effect']} nats.\n")
    w(f"| {by} | scenarios | aligned pairs | flipping, relative rule | flipping, owned rule | owned flips when expected (95% Wilson CI) | unexpected flips | not flipping (configured rule) | excluded |")
    w("|---|---|---|---|---|---|---|---|---|")
    for fam, t in table.items():
        own = t["owned_when_expected"]
        rate = f"{own['k']}/{own['n']} = {own['p']:.2f} ({own['ci'][0]:.2f}-{own['ci'][1]:.2f})" if own["ci"] else "-"
        w(f"| {fam} | {t['n_scenarios']} | {t['n_pairs']} | {t['n_flip_relative']} | {t['n_flip_owned']} | {rate} "
          f"| {t['unexpected_flips']} | {fmt_counts(t['not_flipping'])} | {fmt_counts(t['excluded'])} |")
    agg = rec["result"]["aggregates"]
    w(f"\nTotal: {agg['n_flip']} flipping of {agg['n_pairs']} aligned pairs, in families {', '.join(agg['flip_families']) or 'none'}.")
    return w.text()


#: The columns this probe's records add to the per-family results table (kvnotes table --results).
SCREEN_RESULTS = (ResultsColumn(10, "flipping / aligned pairs", _screen_pairs),)


#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(results=SCREEN_RESULTS, headline=flip_count,
    figures=(Bars("screen-families", "by_family/@/[n_pairs,n_flip_relative,n_flip_owned,n_flip]",
                "screen: pairs per family", "pairs",
                names={"n_pairs": "aligned pairs", "n_flip_relative": "flipping, relative rule",
                       "n_flip_owned": "flipping, owned rule", "n_flip": "flipping, configured rule"}),),
    table=screen_table)
