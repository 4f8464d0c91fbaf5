"""From a scenario config to token-aligned pairs, with exclusions counted by reason.

This is the step ``run.py`` performs before any probe: load the suite, draw instances, render and
tokenise every old/new pair, and set aside those that cannot be compared position by position.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvnotes.errors import KvnotesError
from kvnotes.harness.tokens import TokenizedPair, tokenize_pair, tokenize_polarity_pair
from kvnotes.models.text import thinking_kwargs
from kvnotes.scenarios import build_pairs, load_suite
from kvnotes.scenarios.instances import build_polarity_pairs

if TYPE_CHECKING:
    from kvnotes.harness.readout import PairRun


@dataclass
class PairSet:
    """The pairs a probe works on.

    Attributes:
        pairs: token-aligned pairs, in suite order.
        excluded: rows ``{pair, scenario, family, reason}`` for pairs set aside at tokenisation.
        scenarios: the loaded scenarios (for per-family reporting of empty families).
        skipped: rows ``{scenario, family, reason}`` of scenarios that give no pairs of this kind
            (polarity pairs: scenarios without a ``polarity`` block).
    """

    pairs: list[TokenizedPair]
    excluded: list[dict] = field(default_factory=list)
    scenarios: list = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)

    def exclusion_counts(self) -> dict[str, int]:
        return dict(Counter(r["reason"] for r in self.excluded))


def prepare_pairs(tokenizer, scenario_cfg: Any, polarity: str = "normal",
                  template_kwargs: dict | None = None) -> PairSet:
    """Build the :class:`PairSet` described by a ``conf/scenario/*.yaml`` config.

    Args:
        scenario_cfg: mapping with ``paths``, ``families``, ``ids``, ``n_instances``, ``seed``,
            ``variant``, ``field_placement``, ``chat_template`` and ``transcript``.
        polarity: ``"normal"`` or ``"inverted"`` rule trigger (see :mod:`kvnotes.scenarios.schema`).
        template_kwargs: extra chat-template arguments from the model config.

    Raises:
        KvnotesError: invalid scenario files, an empty selection, or values that do not change tokens.
    """
    scenarios = load_suite(list(scenario_cfg.paths), scenario_cfg.get("families"), scenario_cfg.get("ids"))
    specs = build_pairs(scenarios, int(scenario_cfg.n_instances), int(scenario_cfg.seed),
                        scenario_cfg.get("variant", "direct"), polarity, scenario_cfg.get("field_placement", "first"))
    return _tokenized(PairSet([], [], scenarios), specs, tokenize_pair, tokenizer, scenario_cfg, template_kwargs,
                      turns=transcript_turns(scenario_cfg))


def _tokenized(out: PairSet, specs, tokenize, tokenizer, scenario_cfg: Any, template_kwargs: dict | None,
               **layout) -> PairSet:
    """``out`` with every spec tokenised: aligned pairs appended to ``pairs``, the others to
    ``excluded`` with the tokeniser's reason (``layout``: keywords for the tokeniser, e.g. ``turns``)."""
    for spec in specs:
        tp = tokenize(tokenizer, spec, bool(scenario_cfg.get("chat_template", True)), template_kwargs, **layout)
        if isinstance(tp, str):
            out.excluded.append(pair_meta(spec) | {"reason": tp})
        else:
            out.pairs.append(tp)
    return out


def transcript_turns(scenario_cfg: Any) -> int | None:
    """The unrelated exchanges of a transcript suite (``scenario.transcript.turns``), None for the
    flat layout (:func:`kvnotes.harness.tokens.render_prompt`)."""
    transcript = scenario_cfg.get("transcript")
    return None if transcript is None else int(transcript["turns"])


#: Kinds of pairs a probe can ask for (probe config key ``pairs``; ``none``: the probe reads its own
#: data, e.g. the memory probes' suite, and gets an empty :class:`PairSet`).
PAIR_KINDS = ("field", "polarity", "none")


def prepare_polarity_pairs(tokenizer, scenario_cfg: Any, template_kwargs: dict | None = None,
                           scenarios: list | None = None) -> PairSet:
    """The polarity pairs (field fixed, the rule's trigger word flipped normal -> inverted;
    :class:`kvnotes.harness.tokens.PolarityPair`) of the scenarios a ``conf/scenario/*.yaml`` config selects.

    Args:
        scenarios: the loaded scenarios (default: loaded from ``scenario_cfg``).

    Returns:
        a :class:`PairSet` whose ``skipped`` lists scenarios without a polarity block; pairs whose
        trigger words tokenise to different lengths are excluded (``unequal_trigger_length``).

    Raises:
        KvnotesError: invalid scenario files, or no selected scenario has a polarity block.
    """
    if scenarios is None:
        scenarios = load_suite(list(scenario_cfg.paths), scenario_cfg.get("families"), scenario_cfg.get("ids"))
    specs, skipped = build_polarity_pairs(scenarios, int(scenario_cfg.n_instances), int(scenario_cfg.seed),
                                          scenario_cfg.get("variant", "direct"),
                                          scenario_cfg.get("field_placement", "first"))
    if not specs:
        raise KvnotesError(f"no scenario with a polarity block among the selected ones ({len(skipped)} skipped: "
                           f"{dict(Counter(s['reason'] for s in skipped))}); select e.g. scenario.families=[policy_gate]")
    return _tokenized(PairSet([], [], scenarios, skipped), specs, tokenize_polarity_pair, tokenizer, scenario_cfg,
                      template_kwargs, turns=transcript_turns(scenario_cfg))


def pair_meta(spec) -> dict:
    """Identifying columns of a pair row."""
    inst = spec.instance
    return {"pair": spec.id, "scenario": inst.scenario.id, "family": inst.scenario.family,
            "domain": inst.scenario.domain, "instance": inst.id, "old": spec.old, "new": spec.new,
            "expect_flip": spec.expect_flip}


def pair_row(pair: TokenizedPair) -> dict:
    """Identifying columns plus spans and candidate tokens of a token-aligned pair."""
    return pair_meta(pair.spec) | {
        "field": list(pair.field), "decision": pair.decision, "n_tokens": len(pair.old.ids),
        "cand_old": list(pair.cand_old), "cand_new": list(pair.cand_new),
    }


def template_kwargs(model_cfg: Any) -> dict:
    """The chat-template arguments prompts are rendered with: the model config's
    ``chat_template_kwargs`` with its ``thinking`` switch applied (``enable_thinking``;
    :func:`kvnotes.models.text.thinking_kwargs`)."""
    kwargs = model_cfg.get("chat_template_kwargs")
    return thinking_kwargs(dict(kwargs) if kwargs else None, model_cfg.get("thinking"))


def prepare_for_probe(tokenizer, kind: str, scenario_cfg: Any, model_cfg: Any) -> PairSet:
    """The pairs a probe asks for (``pairs`` of its config: ``field`` -> :func:`prepare_pairs`,
    ``polarity`` -> :func:`prepare_polarity_pairs`, ``none`` -> an empty set), rendered with the model
    config's ``chat_template_kwargs``; what ``run.py`` and ``kvnotes battery`` hand a probe."""
    if kind == "none":
        return PairSet([])
    kwargs = template_kwargs(model_cfg)
    if kind == "polarity":
        return prepare_polarity_pairs(tokenizer, scenario_cfg, template_kwargs=kwargs)
    return prepare_pairs(tokenizer, scenario_cfg, template_kwargs=kwargs)


def outcomes(run: PairRun) -> tuple[str, str]:
    """The outcomes the clean old and new runs of a flipping pair decide: their expected
    candidates' text (stripped), e.g. ``("Berlin", "Madrid")``. Under the ``owned`` flip rule these
    are the model's own top-1 answers."""
    return run.pair.spec.cand_old.strip(), run.pair.spec.cand_new.strip()


def outcome_pair(o_old: str, o_new: str) -> str:
    """Order-free key of an outcome pair (``"A|B"`` with ``A < B``): runs are grouped by the
    conclusion they reach, not by which value the scenario file lists first."""
    return "|".join(sorted((o_old, o_new)))
