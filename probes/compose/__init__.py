"""``compose``: does a prompt composed from precompiled chunks decide like its full prefill (paper §5)?

Specification: ``docs/probes/compose.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Any, ClassVar, Optional

import torch
from annotated_types import Len

from kvnotes.errors import KvnotesError
from kvnotes.harness import kit as K
from kvnotes.harness.chunks import SINKS, chunked_pairs
from kvnotes.probes.compose.arms import FULL_SEAM, edit_arms, image_arm, read_prompts, variant_name
from kvnotes.probes.compose.controls import METRICS, WHERE, composition_controls
from kvnotes.harness.constraints import Count, NonNegative, NonNegatives, one_of, require_field_placement
from kvnotes.harness.kit import ProbeConfig, exclusions_by_family, families_of, summaries_by_family, summary
from kvnotes.harness.pairs import pair_row as pair_row_columns, transcript_turns
from kvnotes.harness.protocol import (Measure, Readout, pair_loop, readout_aggregates, readout_config, readout_of,
                                     summaries)
from kvnotes.harness.reader import prompt_reader
from kvnotes.harness.stats import proportion
from kvnotes.harness.registry import Conformance
from kvnotes.kv.decision import recovery
from kvnotes.kv.engine import make_engine
from kvnotes.ops import compose as kvcompose
from kvnotes.records.figures import Curves, Reshaped
from kvnotes.records.presentation import Presentation
from kvnotes.records.schema import BaseResult
from kvnotes.probes.compose.table import compose_table


#: Why the planted-truth lane cannot score this probe (tests/lanes/test_planted.py).
PLANTED_NOT_SCORED = "the construction is position-independent (rotary frequencies ~0), so re-rotated chunks cannot err"

@dataclass
class Config(ProbeConfig):
    """Keys of ``conf/probe/compose.yaml``
    (the defaults are here; the YAML sets what differs; see the specification). Under
    ``scenario.variant=cot`` ``cot_seams``, ``cot_edit_arm_seams`` and ``cot_controls`` stand in for
    ``seams``, ``edit_arm_seams`` and ``controls`` (:func:`kvnotes.harness.protocol.readout_config`)."""

    #: chunk tokens recomputed against the real prefix (seam repair)
    seams: NonNegatives = field(default_factory=lambda: [0, 1, 2, 4, 8])
    #: precompile chunks behind nothing / the prompt's first token / (prefix) the live prefix
    sinks: Annotated[list[Annotated[str, one_of(*SINKS)]], Len(min_length=1)] = field(
        default_factory=lambda: ["none", "bos"])
    #: seams of the edit-inside-composition arms (erratum; field refreshed in a chunk); [] skips them
    edit_arm_seams: list[NonNegative] = field(default_factory=lambda: [0, 4])
    #: M-RoPE VLMs: also insert a synthetic image (seeded random pixels) as a precompiled chunk
    image_chunk: bool = False
    #: ``[t, h, w]`` patches of the synthetic image chunk
    image_grid: Annotated[list[Count], Len(min_length=3, max_length=3)] = field(default_factory=lambda: [1, 4, 4])
    #: the composition controls per prompt and sink (attention mask, residual stream and norm inputs of the
    #: composed run against the full one; :mod:`kvnotes.probes.compose.controls`)
    controls: bool = True
    #: ``scenario.variant=cot``: most tokens generated per chain, chunked pairs screened, seams composed
    cot_max_new_tokens: NonNegative = 40
    #: chunked pairs screened, round-robin over scenarios (the rest: beyond_max_pairs); null: all
    cot_max_pairs: Optional[Count] = 12
    #: seams of the composed variants under cot (x rotate/no_rotate x sinks)
    cot_seams: NonNegatives = field(default_factory=lambda: [0, 4])
    #: edit arms under cot: none (they read the decision position directly, no generated reasoning)
    cot_edit_arm_seams: list[NonNegative] = field(default_factory=list)
    #: composition controls under cot: off (they compare the prompt's forward, not a decision)
    cot_controls: bool = False

    #: Keys only the direct readout reads: refused under ``scenario.variant=cot`` (:func:`kvnotes.harness.protocol.config_for`).
    DIRECT_ONLY: ClassVar[dict[str, str]] = {"image_chunk": "the image arm reads the decision position directly"}

    def check_run(self, run) -> None:
        """Compose lays out its chunks itself (rule, filler, context, request).

        Raises:
            KvnotesError: ``scenario.field_placement`` other than ``first``.
        """
        require_field_placement(run, "compose", "orders the prompt's lines into its own chunks")


#: With ``scenario.variant=cot`` the full prefill and every composed variant generate their reasoning and
#: the decision is read after the answer marker (:func:`kvnotes.probes.compose.arms.read_prompts`).
SUPPORTS_COT = True


class Result(BaseResult):
    """What ``run`` returns (record ``result``): per-prompt and per-pair rows of every composition
    arm, ``aggregates`` per family."""

    rows: list[dict[str, Any]]
    excluded: list[dict[str, Any]]


def image_summary(prompt_rows: list[dict], image: tuple, cpairs, families: list[str], n_boot: int,
                  seed: int) -> dict:
    """``aggregates.image_chunk``: what the arm inserted and, per variant, top-1 agreement with the full
    prefill (Wilson CI over prompts) and KL(full || composed) (cluster bootstrap)."""
    img, inputs = image
    names = list(prompt_rows[0]["image_chunk"]["variants"])
    first = cpairs.pairs[0].chunk_names[0] if cpairs.pairs else None
    return {"enabled": True, "grid": [int(x) for x in inputs["image_grid_thw"][0].tolist()],
            "n_tokens": len(img), "pixels": f"synthetic: standard normal, seed {seed}",
            "inserted_after_chunk": first, "seam": 0, "reference": "full prefill with the image encoded",
            "variants": {v: {"top1_agreement": proportion(sum(r["image_chunk"]["variants"][v]["top1_agree"]
                                                              for r in prompt_rows), len(prompt_rows)),
                             "kl": summaries_by_family(prompt_rows, lambda r, v=v: r["image_chunk"]["variants"][v]["kl"],
                                                       None, families, n_boot, seed)}
                         for v in names}}


# ---------------------------------------------------------------------------------------------------
# rows: a prompt's reads, a pair's


def _score(reads, pair) -> float | None:
    """The first-token score ``lp[new] - lp[old]`` (nats) of one read, None where its chain missed its marker."""
    lp = reads.logprobs[0]
    return float(lp[pair.cand_new[0]] - lp[pair.cand_old[0]]) if reads.reached(0) else None


def prompt_row(reader, cols: dict, res: dict, expected: int) -> dict:
    """One prompt's row from its :func:`kvnotes.probes.compose.arms.read_prompts` result.

    Args:
        reader: the run's :class:`kvnotes.harness.reader.PromptReader`.
        cols: identifying columns (``prompt``, ``scenario``, ``family``, ``instance``, ``value``).
        res: the prompt's ``{"full": Reads, "variants": {name: Reads}}``.
        expected: the expected candidate's first token id.

    Returns:
        ``cols`` with ``expected_first_token`` and what only the full chain has (``full_chain``,
        :meth:`kvnotes.kv.generate.Chain.record`; ``full_text``, the decoded chain); when the full
        chain missed its marker only ``reason`` (``full_no_marker`` / ``full_truncated_in_think``):
        never scored. Else ``full_top1``, ``owned`` and ``variants``: name -> ``{top1, top1_agree,
        kl}`` (KL(full || composed) in nats; None when the composed chain missed its marker), with
        the logit cosine where the readout has raw logits (:data:`LOGITS`) and what only a chain has
        (``chain``, ``reached``, ``same_chain``, ``unreached_reason``); the direct readout's check
        ``max_abs_logit_diff_full_seam``.
    """
    full = res["full"]
    row = cols | {"expected_first_token": expected} | full.chain_columns(
        0, chain="full_chain", text=("full_text", reader.tokenizer))
    if not full.reached(0):
        assert full.unreached is not None
        return row | {"reason": full.unreached[0]}
    top1 = int(full.logprobs[0].argmax())
    row |= {"full_top1": top1, "owned": top1 == expected, "variants": {}}
    if "max_abs_logit_diff_full_seam" in res:
        row["max_abs_logit_diff_full_seam"] = res["max_abs_logit_diff_full_seam"]
    for name, c in res["variants"].items():
        m = kvcompose.decision_metrics(full.decision(0)[None], c.decision(0)[None]) if c.reached(0) else None
        row["variants"][name] = {
            "top1": int(c.logprobs[0].argmax()) if m is not None else None,
            "top1_agree": None if m is None else bool(m["top1_agree"][0]),
            "kl": None if m is None else float(m["kl"][0])} | LOGITS.of(reader, m) | CHAINS.of(reader, full, c)
    return row


#: The logit cosine of the paper reads raw logits at the decision position: the direct readout's.
LOGITS = Measure("logit_cosine", lambda reader, m: {"logit_cosine": float(m["logit_cosine"][0])},
                 readouts=("direct",),
                 summary=lambda rows, groups, v, families, n_boot, seed: {"logit_cosine": summaries_by_family(
                     rows, lambda r: r["variants"][v]["logit_cosine"], None, families, n_boot, seed)})
#: What only a composed variant's chain has: its record, whether it reached its marker (and why not),
#: whether it is the full prefill's chain token for token (summary: the share that is, per group).
CHAINS = Measure("chains", lambda reader, full, c: c.chain_columns(
    0, chain="chain", reached="reached", same=("same_chain", full.chain_ids(0)), unreached="unreached_reason"),
    readouts=("generated",),
    summary=lambda rows, groups, v, families, n_boot, seed: {"same_chain": {
        g: proportion(sum(r["variants"][v]["same_chain"] for r in rs), len(rs)) for g, rs in groups.items()}})


def pair_row(pair, screen: dict, ro: dict, rn: dict, names: list[str]) -> dict:
    """A pair's row from its prompts' :func:`kvnotes.probes.compose.arms.read_prompts` results (both
    full chains reached their markers).

    Args:
        screen: the pair's row from the protocol's screen (:func:`kvnotes.harness.protocol.pair_loop`:
            its flip under the run's readout).

    Returns:
        ``screen`` with the chunk spans, ``s_full`` (the full prefills' first-token scores),
        ``full_side`` (the candidate each decides for) and per variant ``{s_old, s_new, r, side_new,
        takes_new}`` of the composed runs (``r``: recovery against the full prefills; ``takes_new``:
        the composed new run decides as the full new run does; None where a chain missed its marker),
        with ``reached`` (the composed new chain reached its marker) where there are chains.
    """
    s_old, s_new = _score(ro["full"], pair), _score(rn["full"], pair)
    full_side = [ro["full"].side(0, pair), rn["full"].side(0, pair)]
    row = screen | {"chunks": [list(c) for c in pair.chunks], "chunk_names": list(pair.chunk_names),
                    "standalone": list(pair.standalone), "s_full": [s_old, s_new], "full_side": full_side,
                    "variants": {}}
    for name in names:
        co, cn = ro["variants"][name], rn["variants"][name]
        sc_new, side = _score(cn, pair), cn.side(0, pair)
        row["variants"][name] = {"s_old": _score(co, pair), "s_new": sc_new, "r": recovery(sc_new, s_old, s_new),
                                 "side_new": side, "takes_new": None if side is None else side == full_side[1]
                                 } | cn.chain_columns(0, reached="reached")
    return row


def aggregate(prompt_rows: list[dict], pair_rows: list[dict], names: list[str], families: list[str], n_boot: int,
              seed: int, readout: Readout) -> dict:
    """Per variant and group (``all`` and each family), over distinct prompts whose full chain
    reached its marker: ``decision_agreement`` (owned prompts whose composed run names the full
    prefill's top-1; Wilson CI), ``top1_agreement`` (the same over every prompt), ``kl``
    (KL(full || composed), cluster bootstrap); a composed chain that missed its marker is left out
    of these and counted (``n_unreached``; 0 under the direct readout). Over pairs that flip:
    ``new_decision`` (the composed new run decides as the full one does; Wilson CI) and ``recovery``
    (:func:`kvnotes.harness.kit.summaries_by_family`). With the measures of the run's ``readout``
    (:func:`kvnotes.harness.protocol.summaries`): ``logit_cosine`` (:data:`LOGITS`), ``same_chain``
    (:data:`CHAINS`: the composed chain is the full chain token for token)."""
    out = {}
    groups = {g: prompt_rows if g == "all" else [r for r in prompt_rows if r["family"] == g] for g in ["all", *families]}
    flipping = [r for r in pair_rows if r["flips"]]
    fgroups = {g: flipping if g == "all" else [r for r in flipping if r["family"] == g] for g in groups}
    for v in names:
        def share(rs: list[dict], key: str, v: str = v) -> dict:
            done = [r["variants"][v][key] for r in rs if r["variants"][v].get("reached", True)]
            return proportion(sum(bool(x) for x in done), len(done))

        out[v] = {
            "decision_agreement": {g: share([r for r in rs if r["owned"]], "top1_agree") for g, rs in groups.items()},
            "top1_agreement": {g: share(rs, "top1_agree") for g, rs in groups.items()},
            "kl": summaries_by_family(prompt_rows, lambda r, v=v: r["variants"][v]["kl"], None, families, n_boot, seed),
            "n_unreached": {g: sum(not r["variants"][v].get("reached", True) for r in rs) for g, rs in groups.items()},
            "new_decision": {g: share(rs, "takes_new") for g, rs in fgroups.items()},
            "recovery": summaries_by_family(flipping, lambda r, v=v: r["variants"][v]["r"],
                                            lambda r, v=v: r["variants"][v]["takes_new"], families, n_boot, seed)}
        out[v] |= summaries(readout, (LOGITS, CHAINS), prompt_rows, groups, v, families, n_boot, seed)
    return out


def aggregate_arms(rows: list[dict], seams: list[int], families: list[str], n_boot: int, seed: int) -> dict:
    """Per arm, method and seam: agreement with the edited-text oracle on pairs whose oracle owns its
    decision, share with the new value's candidate as top-1 (accuracy), and mean KL(oracle || method)."""
    out = {}
    for arm, methods in (("erratum", ("composed", "full")), ("field_in_chunk", ("refreshed", "stale"))):
        rs = [r for r in rows if "excluded" not in r["arms"][arm]]
        out[arm] = {"n": len(rs), "excluded": len(rows) - len(rs)}
        for meth in methods:
            for i, seam in enumerate(seams):
                if arm == "erratum" and meth == "full" and i:
                    continue
                key = meth if (arm == "erratum" and meth == "full") else f"{meth}/seam={seam}"
                owned = [r for r in rs if r["arms"][arm]["oracle_owned"]]
                out[arm][key] = {
                    "agreement_owned": proportion(sum(r["arms"][arm][meth]["top1_agree"][i] for r in owned), len(owned)),
                    "accuracy": proportion(sum(r["arms"][arm][meth]["correct"][i] for r in rs), len(rs)),
                    "kl": summaries_by_family(rs, lambda r, a=arm, m=meth, i=i: r["arms"][a][m]["kl"][i], None,
                                              families, n_boot, seed)["all"]}
    return out


def _prompts_to_read(pairs: list, at: int, memo: dict, batch_later: bool) -> dict:
    """``value -> (prompt, candidate)`` of the prompts of ``pairs[at]`` not read yet and, with
    ``batch_later``, of the later pairs of its instance that share its chunk spans and length (one
    batch)."""
    pair, inst = pairs[at], pairs[at].spec.instance.id
    todo: dict = {}
    for q in pairs[at:] if batch_later else [pair]:
        if q.spec.instance.id != inst:
            break
        if q is pair or (q.chunks == pair.chunks and len(q.old.ids) == len(pair.old.ids)):
            for v, prompt, cand in ((q.spec.old, q.old, q.cand_old), (q.spec.new, q.new, q.cand_new)):
                if (inst, v) not in memo:
                    todo.setdefault(v, (prompt, cand))
    return todo


def suite_order(suite: list, pr) -> tuple[list, list[dict]]:
    """The screened pairs of ``pr`` (:class:`kvnotes.harness.protocol.PairRows`, ``keep=True``) and
    their rows in suite order: an instance's pairs share prompts and are read together, one after
    another (the generated screen takes them round-robin over scenarios)."""
    index = {id(p): i for i, p in enumerate(suite)}
    order = sorted(range(len(pr.pairs)), key=lambda i: index[id(pr.pairs[i].pair)])
    return [pr.pairs[i].pair for i in order], [pr.rows[i] for i in order]


def run(ctx) -> dict:
    """Composed vs full prefill for every chunked pair and variant under the run's readout; see the
    specification.

    The chunked pairs are screened by the protocol (:func:`kvnotes.harness.protocol.pair_loop`: the
    run's flip rule, or the clean chains; ``cot_max_pairs``), every screened pair is measured, and
    an instance's prompts are read once, together (:func:`kvnotes.probes.compose.arms.read_prompts`).

    Returns:
        ``rows`` (screened pairs whose full prefills both reached their markers), ``prompts`` (their
        distinct prompts whose full prefill did), ``exclusions``, ``excluded``, ``variant_names`` and
        ``aggregates`` (:func:`aggregate` under ``variants``).

    Raises:
        KvnotesError: no scenario config, no chunked token-aligned pairs.
    """
    cfg = readout_config(ctx)               # under cot: cot_seams, cot_edit_arm_seams, cot_controls
    if ctx.scenario_cfg is None:
        raise KvnotesError("probe compose needs the scenario config (it renders its own chunked prompts)")
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    n_boot = cfg.n_boot
    sinks = [str(s) for s in cfg.sinks]
    seams, arm_seams = [int(s) for s in cfg.seams], [int(s) for s in cfg.edit_arm_seams]
    variants = [(rot, sink, seam) for rot in (True, False) for sink in sinks for seam in seams]
    names = [variant_name(*v) for v in variants]
    tk = dict(ctx.template_kwargs)          # the model's chat-template arguments, thinking switch applied
    image = None
    if cfg.image_chunk:
        from kvnotes.ops import mrope

        image = mrope.synthetic_image(model, tuple(int(x) for x in cfg.image_grid), ctx.seed)
    with ctx.timer("chunked_pairs"):
        cpairs = chunked_pairs(tok, ctx.scenario_cfg, tk)
    if not cpairs.pairs:
        raise KvnotesError(f"no chunked token-aligned pairs (excluded: {cpairs.exclusion_counts()})")
    cctx = replace(ctx, pairs=cpairs)
    pr = pair_loop(cctx, "compose screen", scope="all", keep=True)
    pairs, screened = suite_order(cpairs.pairs, pr)
    engine = make_engine(model) if cfg.controls else None
    readout = readout_of(ctx)
    prompt_rows, rows, bad_prompts, bad_pairs, memo = [], [], [], [], {"chunks": {}}
    for at, pair in enumerate(K.units(ctx, pairs, "compose")):
        inst, sc = pair.spec.instance.id, pair.spec.instance.scenario
        if any(k[0] != inst for k in memo if isinstance(k, tuple)):
            memo = {"chunks": {}}                       # pairs of one instance are consecutive
        reader = prompt_reader(ctx, sc)
        todo = _prompts_to_read(pairs, at, memo, batch_later=True)
        if todo:
            with ctx.timer("variants"):
                res = read_prompts(model, reader, torch.stack([p.ids for p, _ in todo.values()]), pair.chunks,
                                   variants, memo["chunks"])
            for (value, (prompt, cand)), r in zip(todo.items(), res):
                memo[(inst, value)] = r
                cols = {"prompt": f"{inst}:{value}", "scenario": sc.id, "family": sc.family, "instance": inst,
                        "value": value}
                row = prompt_row(reader, cols, r, cand[0])
                if "reason" in row:                     # its full chain missed its marker: never scored
                    bad_prompts.append(row)
                    continue
                prompt_rows.append(row)
                if engine is not None:
                    with ctx.timer("controls"):
                        row["controls"] = composition_controls(
                            model, engine, prompt.ids, pair.chunks, sinks, memo["chunks"],
                            {s: r["variants"][n].logprobs[0] if (n := variant_name(True, s, 0)) in r["variants"]
                             else None for s in sinks})
                if image is not None:
                    with ctx.timer("image_chunk"):
                        row["image_chunk"] = image_arm(model, prompt.ids, pair.chunks, sinks, image)
        ro, rn = memo[(inst, pair.spec.old)], memo[(inst, pair.spec.new)]
        missed = [(side, r["full"]) for side, r in (("old", ro), ("new", rn)) if not r["full"].reached(0)]
        if missed:                                      # the screen's chain reached its marker, this one did not
            bad_pairs.append({k: x for k, x in pair_row_columns(pair).items() if k in K.EXCLUSION_COLUMNS}
                             | {"reason": reader.unreached_reason(missed[0][0], missed[0][1])})
            continue
        rows.append(pair_row(pair, screened[at], ro, rn, names))
        if arm_seams:
            with ctx.timer("edit_arms"):
                rows[-1]["arms"] = edit_arms(model, tok, pair, arm_seams, tk, ctx.scenario.chat_template,
                                             memo.setdefault("arms", {}), rn["full"].logprobs[0],
                                             transcript_turns(ctx.scenario_cfg))
    excluded = [*pr.excluded, *bad_prompts, *bad_pairs]
    exclusions = K.exclusion_counts(excluded) | {k: v for k, v in pr.exclusions.items() if k == "beyond_max_pairs"}
    families = families_of(cctx, rows + prompt_rows + bad_prompts)
    with ctx.timer("statistics"):
        agg = aggregate(prompt_rows, rows, names, families, n_boot, ctx.seed, readout)
        arms = aggregate_arms(rows, arm_seams, families, n_boot, ctx.seed) if arm_seams else None
    checks = {"pairs_with_chunks_tokenised_standalone": sum(all(r["standalone"]) for r in rows), "n_rows": len(rows)}
    checks |= summaries(readout, (FULL_SEAM,), prompt_rows)
    aggregates = {"n_pairs": len(cpairs.pairs) + len(cpairs.excluded), "n_aligned": len(cpairs.pairs),
                  "n_flip": sum(r["flips"] for r in rows), "n_prompts": len(prompt_rows),
                  "n_owned_prompts": sum(r["owned"] for r in prompt_rows), "families": families, "sinks": sinks,
                  "seams": seams, "variants": agg, "exclusions_by_family": exclusions_by_family(excluded, families),
                  "edit_arm_seams": arm_seams, "checks": checks,
                  "n_prompts_screened": len(prompt_rows) + len(bad_prompts),
                  "prompt_exclusions": K.exclusion_counts(bad_prompts),
                  "n_unreached": {v: agg[v]["n_unreached"]["all"] for v in names},
                  "edit_arms": arms, "edit_arms_note": None if arm_seams else EDIT_ARMS_NOTE,
                  "controls": control_summary(prompt_rows, sinks, n_boot, ctx.seed) if engine is not None else None,
                  "image_chunk": None if image is None else image_summary(prompt_rows, image, cpairs, families,
                                                                          n_boot, ctx.seed)}
    return {"rows": rows, "prompts": prompt_rows, "exclusions": exclusions, "excluded": excluded,
            "variant_names": names, "aggregates": aggregates | readout_aggregates(cctx, pr)}


#: ``aggregates.edit_arms_note`` of a record without edit arms.
EDIT_ARMS_NOTE = ("edit arms not run: no edit_arm_seams (under scenario.variant=cot, cot_edit_arm_seams, [] by "
                  "default: the arms read the decision position directly)")


def control_summary(prompt_rows: list[dict], sinks: list[str], n_boot: int, seed: int) -> dict:
    """``aggregates.controls``: per sink (``sink=<name>``), per place (:data:`WHERE`) and metric
    (:data:`METRICS`), the per-layer mean over prompts with an interval fitted to the clusters, and
    ``context_seen``; ``check_abs_logprob_diff``: the largest difference between the control's composed
    decision and the probe's own (rotate, seam 0) variant."""
    out: dict = {}
    for sink in sinks:
        rows = [r for r in prompt_rows if r.get("controls")]
        n_layers = len(rows[0]["controls"][sink][WHERE[0]][METRICS[0]]) if rows else 0
        out[f"sink={sink}"] = {where: {m: {layer: summary(rows, lambda r, w=where, m=m, i=layer: r["controls"][sink][w][m][i],
                                                          n_boot, seed)
                                           for layer in range(n_layers)} for m in METRICS}
                               for where in WHERE} | {
            "context_seen": summary(rows, lambda r: r["controls"][sink]["context_seen"], n_boot, seed)}
    diffs = [c["check_abs_logprob_diff"] for r in prompt_rows for c in (r.get("controls") or {}).values()
             if c["check_abs_logprob_diff"] is not None]
    return out | {"check_abs_logprob_diff": max(diffs, default=None)}


def by_seam(res: dict) -> dict:
    """A ``compose`` record's ``variants`` (``rotate/sink=bos/seam=4`` -> metrics) as
    ``metric -> "rotate sink=bos" -> seam -> group -> summary`` for :class:`kvnotes.records.figures.Curves`."""
    out: dict = {}
    for name, d in ((res.get("aggregates") or {}).get("variants") or {}).items():
        parts = str(name).split("/")
        if not isinstance(d, dict) or len(parts) != 3 or not parts[2].startswith("seam="):
            continue
        for metric, by_group in d.items():
            out.setdefault(metric, {}).setdefault(f"{parts[0]} {parts[1]}", {})[parts[2][5:]] = by_group
    return out



#: How this probe's records are shown: the report's headline, its figures, its table
#: (:mod:`kvnotes.records.presentation`).
PRESENTATION = Presentation(figures=(
    Reshaped(Curves("seam-agreement", "decision_agreement/*/#/@", "compose: decision agreement with the full "
                    "prefill by seam (owned prompts; Wilson 95%)", "seam tokens", "agreement"), by_seam),
    Reshaped(Curves("seam-kl", "kl/*/#/@", "compose: KL(full || composed) by seam (mean, 95% interval)",
                    "seam tokens", "KL (nats)", ylog=True), by_seam),
    *(Curves(f"controls-{m}", f"controls/*/@/{m}/#", f"composition controls: {what} of the composed run against the "
             "full recompute, per layer (mean over prompts, 95% interval)", "layer", what)
      for m, what in (("rel_l2", "relative L2 distance of the residual stream"),
                      ("rms_ratio_attn_norm", "RMS ratio of the attention norm's input")))),
    table=compose_table)


#: The zoo conformance lane's settings for it; on multimodal entries one seam and no edit arms (Qwen2.5-VL
#: keeps its 2048 width when shrunk) (:class:`kvnotes.harness.registry.Conformance`).
CONFORMANCE = Conformance(bounds=("probe.seams=[0,2]", "probe.sinks=[bos]", "probe.edit_arm_seams=[0]"),
                          mrope=("probe.seams=[0]", "probe.edit_arm_seams=[]"))
