"""``locomo``: LoCoMo question answering with transplanted conversation memory against a full prefill.

Specification: ``docs/probes/locomo.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Optional

from kvnotes.errors import KvnotesError
from kvnotes.harness.constraints import Count, Counts, NonNegative, PositiveFloat, one_of
from kvnotes.harness.kit import ProbeConfig
from kvnotes.harness.locomo import DEFAULT_CATEGORIES, run_locomo_qa
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import TypedDict


def format_summary(result: dict, name: str = "model") -> str:
    """The printed report of :func:`kvnotes.harness.locomo.run_locomo_qa`'s result."""
    s, c = result["summary"], result["config"]
    lines = [f"# locomo QA: {name}; {s['n_questions']} question(s) from {s['n_samples']} conversation(s), "
             f"categories {','.join(map(str, c['categories']))}; composed = session chunks "
             f"{'rotated' if c['rotate'] else 'NOT rotated'} into place (seam {c['seam']}) vs full prefill; "
             f"greedy, <= {c['max_new_tokens']} new tokens, context <= {c['max_context']}"]
    if not s["n_questions"]:
        return "\n".join(lines + ["no questions answered"])
    lines.append(f"{'arm':<10} {'F1':>6}   contains (95% Wilson)")
    for arm in ("composed", "full"):
        a = s["arms"][arm]
        ci = a["contains"]["ci"]
        lines.append(f"{arm:<10} {a['f1_mean']:6.3f}   {a['contains']['k']}/{a['contains']['n']} = "
                     f"{a['contains']['p']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]")
    kl = s["first_step_kl"]
    lines.append(f"same answer {s['same_answer']['k']}/{s['same_answer']['n']}; first-step KL(full || composed) "
                 f"mean {kl['mean']:.3g} nats, median {kl['median']:.3g} ({kl['n_scenarios']} conversation cluster(s))")
    mc = s["mcnemar"]
    lines.append(f"exact McNemar on containment: {mc['b']} composed-only right, {mc['c']} full-only right, "
                 f"p = {mc['p']:.3g}")
    t = s["f1_tost"]
    if "skipped" in t:
        lines.append(f"TOST on F1 (margin {c['margin']}): skipped ({t['skipped']})")
    else:
        lines.append(f"TOST on F1 (margin {t['margin']}, {t['n_clusters']} conversation clusters): mean difference "
                     f"{t['mean_diff']:+.3f}, {t['ci_level']:.0%} CI [{t['ci'][0]:+.3f}, {t['ci'][1]:+.3f}], "
                     f"p = {t['p']:.3g}, equivalent: {'yes' if t['equivalent'] else 'no'}")
    return "\n".join(lines)


@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/locomo.yaml`` (see the specification).

    Attributes:
        data: the LoCoMo file; ``scenario.locomo`` sets it (a scenario input of the record).
        max_questions: most questions in all, in file order (None: every one).
        max_new_tokens: most answer tokens per arm.
        categories: question categories scored (5 is adversarial: its gold is "not mentioned").
        max_context: most tokens of a prompt plus its answer (None: the model's ``max_position_embeddings``).
        seam: tokens of each chunk recomputed against the real prefix (seam repair).
        rotate: rotate the chunks' keys into place (false: the no-rotate control).
        margin: the declared TOST margin on the per-question F1 difference (composed - full).
    """

    pairs: Annotated[str, one_of("none")] = "none"
    data: Optional[str] = None
    max_questions: Optional[Count] = None
    max_new_tokens: Count = 32
    categories: Counts = field(default_factory=lambda: list(DEFAULT_CATEGORIES))
    max_context: Optional[Count] = None
    seam: NonNegative = 0
    rotate: bool = True
    margin: PositiveFloat = 0.05


class Result(TypedDict):
    """What ``run`` returns (record ``result``): one row per question (keys of the records of
    :func:`kvnotes.harness.locomo.run_locomo_qa`), the summary of
    :func:`kvnotes.harness.locomo.summarize_qa` as ``aggregates``, the settings as run."""

    rows: list[dict[str, Any]]
    aggregates: dict[str, Any]
    exclusions: dict[str, int]
    excluded: list[dict[str, Any]]
    config: dict[str, Any]


def run(ctx) -> dict:
    """Answer the questions of the scenario's LoCoMo file on both arms (see the specification).

    Raises:
        KvnotesError: no LoCoMo file (``scenario.locomo``).
        ScenarioError: a malformed LoCoMo file.
    """
    from kvnotes.scenarios.locomo import load_locomo
    from kvnotes.scenarios.schema import resolve_path

    cfg = ctx.cfg
    if not cfg.data:
        raise KvnotesError("probe locomo reads a LoCoMo file: scenario=locomo scenario.locomo=PATH "
                           "(LoCoMo's data/locomo10.json; not shipped)")
    samples = load_locomo(resolve_path(str(cfg.data)))
    res = run_locomo_qa(ctx.bundle.model, ctx.bundle.tokenizer, samples, cfg.max_questions, int(cfg.max_new_tokens),
                        tuple(cfg.categories), cfg.max_context, bool(cfg.rotate), int(cfg.seam), float(cfg.margin))
    return {"rows": res["records"], "aggregates": res["summary"], "exclusions": {}, "excluded": [],
            "config": res["config"]}


def locomo_table(rec: dict) -> str:
    """A locomo record's report (:func:`format_summary`)."""
    res = rec["result"]
    return format_summary({"summary": res["aggregates"], "config": res["config"]}, rec["model"]["name"])


#: How this probe's records are shown (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(table=locomo_table)
