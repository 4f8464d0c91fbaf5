"""``compose``: does a prompt composed from precompiled chunks decide like its full prefill (paper §5)?

Specification: ``docs/probes/compose.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Optional

import torch
from annotated_types import Len

from kvnotes.errors import KvnotesError
from kvnotes.harness import kit as K
from kvnotes.harness.chunks import SINKS, chunked_pairs
from kvnotes.probes.compose.arms import compose_prompts, cot_generate, edit_arms, image_arm, variant_name
from kvnotes.probes.compose.controls import METRICS, WHERE, composition_controls
from kvnotes.harness.constraints import Count, NonNegative, NonNegatives, one_of, require_field_placement
from kvnotes.harness.kit import ProbeConfig, exclusions_by_family, families_of, flipping_pairs, summaries_by_family, summary
from kvnotes.harness.pairs import pair_row, transcript_turns
from kvnotes.harness.stats import proportion
from kvnotes.harness.registry import Conformance
from kvnotes.kv.decision import recovery
from kvnotes.kv.engine import make_engine
from kvnotes.kv.generate import owned_side, stop_tokens
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
    (the defaults are here; the YAML sets what differs; see the specification)."""

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
    #: ``scenario.variant=cot``: most tokens generated per chain, chunked pairs screened, seams composed
    cot_max_new_tokens: NonNegative = 40
    #: chunked pairs screened, round-robin over scenarios (the rest: beyond_max_pairs); null: all
    cot_max_pairs: Optional[Count] = 12
    #: seams of the composed variants under cot (x rotate/no_rotate x sinks)
    cot_seams: NonNegatives = field(default_factory=lambda: [0, 4])
    #: direct readout: the composition controls per prompt and sink (attention mask, residual stream
    #: and norm inputs of the composed run against the full one; :mod:`kvnotes.probes.compose.controls`)
    controls: bool = True

    def check_run(self, run) -> None:
        """Compose lays out its chunks itself (rule, filler, context, request).

        Raises:
            KvnotesError: ``scenario.field_placement`` other than ``first``.
        """
        require_field_placement(run, "compose", "orders the prompt's lines into its own chunks")


#: With ``scenario.variant=cot`` the full prefill and every composed variant generate their reasoning and
#: the decision is read after the answer marker (:func:`kvnotes.probes.compose.arms.cot_generate`).
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
# chain of thought (scenario.variant=cot): the decision read after a generated chain


def cot_prompt_row(ctx, cols: dict, res: dict, expected: int) -> dict:
    """One prompt's row from its :func:`kvnotes.probes.compose.arms.cot_generate` result.

    Args:
        cols: identifying columns (``prompt``, ``scenario``, ``family``, ``instance``, ``value``).
        res: the prompt's ``{"full": ..., "variants": ...}``.
        expected: the expected candidate's first token id.

    Returns:
        ``cols`` with ``expected_first_token``, ``full_chain`` (:meth:`kvnotes.kv.generate.Chain.record`),
        ``full_text`` (the decoded chain, None without a tokenizer) and ``reason``: None, or
        ``full_no_marker`` / ``full_truncated_in_think`` (:func:`kvnotes.harness.kit.cot_unreached`)
        when the full chain missed its marker (no further columns: never scored). Else also
        ``full_top1`` and ``owned`` (after the full chain's marker) and ``variants``: name ->
        ``{chain, reached, top1, top1_agree, kl, same_chain, unreached_reason}`` (``top1`` /
        ``top1_agree`` / ``kl`` = KL(full || composed) in nats are None when the composed chain
        missed its marker).
    """
    chain, lp = res["full"]
    tok = ctx.bundle.tokenizer
    row = cols | {"expected_first_token": expected, "full_chain": chain.record(),
                  "full_text": None if tok is None else tok.decode(chain.ids, skip_special_tokens=True)}
    if not chain.reached:
        return row | {"reason": K.cot_unreached(ctx, "full", chain)}
    top1 = int(lp.argmax())
    row |= {"full_top1": top1, "owned": top1 == expected, "reason": None, "variants": {}}
    for name, (c, clp) in res["variants"].items():
        m = kvcompose.decision_metrics(lp[None], clp[None]) if c.reached else None
        row["variants"][name] = {
            "chain": c.record(), "reached": c.reached, "top1": int(clp.argmax()) if c.reached else None,
            "top1_agree": None if m is None else bool(m["top1_agree"][0]),
            "kl": None if m is None else float(m["kl"][0]), "same_chain": c.ids == chain.ids,
            "unreached_reason": None if c.reached else K.cot_unreached(ctx, "composed", c)}
    return row


def cot_pair_row(pair, ro: dict, rn: dict, names: list[str]) -> dict:
    """A pair's row from its prompts' :func:`kvnotes.probes.compose.arms.cot_generate` results (both
    full chains reached their markers).

    Returns:
        :func:`kvnotes.harness.pairs.pair_row` columns, the chunk spans, ``s_old`` / ``s_new`` /
        ``s_full`` (first-token scores ``lp[new] - lp[old]`` after the full chains' markers),
        ``full_side`` (:func:`kvnotes.kv.generate.owned_side` of each), ``flips`` (the generated flip:
        old chain names the old candidate, new chain the new one), ``reason`` (None or
        ``no_cot_flip``), and per variant ``{reached, side_new, takes_new, s_new, r}`` of the composed
        new chain (None where it missed its marker; ``r`` = recovery against the full chains).
    """
    co, cn = pair.cand_old[0], pair.cand_new[0]
    lo, ln = ro["full"][1], rn["full"][1]
    s_old, s_new = float(lo[cn] - lo[co]), float(ln[cn] - ln[co])
    sides = [owned_side(lo, pair), owned_side(ln, pair)]
    flips = sides == ["old", "new"]
    row = pair_row(pair) | {"chunks": [list(c) for c in pair.chunks], "chunk_names": list(pair.chunk_names),
                            "standalone": list(pair.standalone), "s_old": s_old, "s_new": s_new,
                            "effect": s_new - s_old, "s_full": [s_old, s_new], "full_side": sides, "flips": flips,
                            "reason": None if flips else "no_cot_flip", "variants": {}}
    for name in names:
        c, lp = rn["variants"][name]
        s = float(lp[cn] - lp[co]) if c.reached else None
        side = owned_side(lp, pair) if c.reached else None
        row["variants"][name] = {"reached": c.reached, "side_new": side,
                                 "takes_new": (side == "new") if c.reached else None, "s_new": s,
                                 "r": recovery(s, s_old, s_new)}
    return row


def aggregate(prompt_rows: list[dict], pair_rows: list[dict], names: list[str], families: list[str], n_boot: int,
              seed: int, generated: bool) -> dict:
    """Per variant and group (``all`` and each family), over distinct prompts (generated readout: those
    whose full chain reached its marker): ``decision_agreement`` (owned prompts whose composed run
    names the full prefill's top-1; Wilson CI), ``top1_agreement`` (the same over every prompt),
    ``kl`` (KL(full || composed), cluster bootstrap); a composed chain that missed its marker is
    left out of these and counted (``n_unreached``). Direct readout: ``logit_cosine``, and
    ``recovery`` over pairs that flip (the flag: the composed new run takes the new decision).
    Generated readout: ``same_chain`` (the composed chain is the full chain token for token), and over
    generated flips ``new_decision`` (Wilson CI) and ``recovery``
    (:func:`kvnotes.harness.kit.summaries_by_family`)."""
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
            "kl": summaries_by_family(prompt_rows, lambda r, v=v: r["variants"][v]["kl"], None, families, n_boot, seed)}
        if not generated:
            out[v] |= {
                "logit_cosine": summaries_by_family(prompt_rows, lambda r, v=v: r["variants"][v]["logit_cosine"], None,
                                                    families, n_boot, seed),
                "recovery": summaries_by_family(
                    pair_rows, lambda r, v=v: r["variants"][v]["r"] if r["flips"] else None,
                    lambda r, v=v: (r["variants"][v]["s_new"] > 0) == (r["s_full"][1] > 0), families, n_boot, seed)}
            continue
        out[v] |= {
            "same_chain": {g: proportion(sum(r["variants"][v]["same_chain"] for r in rs), len(rs))
                           for g, rs in groups.items()},
            "n_unreached": {g: sum(not r["variants"][v]["reached"] for r in rs) for g, rs in groups.items()},
            "new_decision": {g: share(rs, "takes_new") for g, rs in fgroups.items()},
            "recovery": summaries_by_family(flipping, lambda r, v=v: r["variants"][v]["r"],
                                            lambda r, v=v: r["variants"][v]["takes_new"], families, n_boot, seed)}
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


#: ``aggregates.edit_arms_note`` of a cot record.
EDIT_ARMS_COT_NOTE = ("edit arms not run under scenario.variant=cot: they read the decision position directly "
                      "(no generated reasoning)")


def _direct_prompt_row(cols: dict, res: dict, expected: int) -> dict:
    """One prompt's row from its :func:`kvnotes.probes.compose.arms.compose_prompts` result (the direct readout)."""
    top1 = int(res["full"].argmax())
    return cols | {"expected_first_token": expected, "full_top1": top1, "owned": top1 == expected,
                   "max_abs_logit_diff_full_seam": res["max_abs_logit_diff_full_seam"],
                   "variants": {n: {k: x for k, x in d.items() if k != "logprobs"} for n, d in res["variants"].items()}}


def _direct_pair_row(pair, ro: dict, rn: dict, names: list[str], flips: bool) -> dict:
    """A pair's row from its prompts' :func:`kvnotes.probes.compose.arms.compose_prompts` results (the
    direct readout): the full prefills' scores and per variant the composed runs' scores and
    recovery."""
    co, cn = pair.cand_old[0], pair.cand_new[0]
    s_old, s_new = float(ro["full"][cn] - ro["full"][co]), float(rn["full"][cn] - rn["full"][co])
    row = pair_row(pair) | {"chunks": [list(c) for c in pair.chunks], "chunk_names": list(pair.chunk_names),
                            "standalone": list(pair.standalone), "flips": flips, "s_full": [s_old, s_new], "variants": {}}
    for name in names:
        lo, ln = ro["variants"][name]["logprobs"], rn["variants"][name]["logprobs"]
        sc_old, sc_new = float(lo[cn] - lo[co]), float(ln[cn] - ln[co])
        row["variants"][name] = {"s_old": sc_old, "s_new": sc_new,
                                 "r": recovery(sc_new, s_old, s_new)}
    return row


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


def run(ctx) -> dict:
    """Composed vs full prefill for every chunked pair and variant under the run's readout; see the
    specification.

    Returns:
        ``rows`` (pairs; generated: those whose full chains both reached their markers), ``prompts``
        (distinct prompts; generated: those whose full chain did), ``exclusions``, ``excluded``,
        ``variant_names`` and ``aggregates`` (:func:`aggregate` under ``variants``; generated:
        ``readout = "generated"``).

    Raises:
        KvnotesError: no scenario config, no chunked token-aligned pairs, ``image_chunk: true``
            under the generated readout.
    """
    cfg = ctx.cfg
    generated = K.is_cot(ctx)
    if generated and cfg.image_chunk:
        raise KvnotesError("probe.image_chunk=true is not run under scenario.variant=cot (the image arm reads the "
                           "decision position directly); set probe.image_chunk=false")
    if ctx.scenario_cfg is None:
        raise KvnotesError("probe compose needs the scenario config (it renders its own chunked prompts)")
    model, tok = ctx.bundle.model, ctx.bundle.tokenizer
    n_boot = cfg.n_boot
    sinks = [str(s) for s in cfg.sinks]
    seams = [int(s) for s in (cfg.cot_seams if generated else cfg.seams)]
    arm_seams = [] if generated else [int(s) for s in cfg.edit_arm_seams]
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
    if generated:                           # the full chains are the screen: a prompt's is decoded once
        limit = cfg.cot_max_pairs
        chosen, beyond = K.cot_selection(cctx, None if limit is None else int(limit))
        index = {id(p): i for i, p in enumerate(cpairs.pairs)}
        pairs, flips = sorted(chosen, key=lambda p: index[id(p)]), set()   # suite order: an instance's pairs share prompts
        max_new, stop = cfg.cot_max_new_tokens, stop_tokens(tok)
    else:
        fs = flipping_pairs(cctx, keep_caches=False)
        pairs, beyond, flips = cpairs.pairs, 0, {r["pair"] for r in fs.rows}
    engine = make_engine(model) if cfg.controls and not generated else None
    prompt_rows, rows, bad_prompts, bad_pairs, memo = [], [], [], [], {"chunks": {}}
    for at, pair in enumerate(K.units(ctx, pairs, "compose")):
        inst, sc = pair.spec.instance.id, pair.spec.instance.scenario
        if any(k[0] != inst for k in memo if isinstance(k, tuple)):
            memo = {"chunks": {}}                       # pairs of one instance are consecutive
        todo = _prompts_to_read(pairs, at, memo, batch_later=not generated)
        if todo:
            with ctx.timer("generate" if generated else "variants"):
                res = (cot_generate(model, torch.stack([p.ids for p, _ in todo.values()]), pair.chunks, variants,
                                    max_new, K.cot_marker(ctx, pair), stop) if generated else
                       compose_prompts(model, [p for p, _ in todo.values()], pair.chunks, variants, memo["chunks"]))
            for (value, (prompt, cand)), r in zip(todo.items(), res):
                memo[(inst, value)] = r
                cols = {"prompt": f"{inst}:{value}", "scenario": sc.id, "family": sc.family, "instance": inst,
                        "value": value}
                if generated:
                    row = cot_prompt_row(ctx, cols, r, cand[0])
                    (prompt_rows if row["reason"] is None else bad_prompts).append(row)
                    continue
                prompt_rows.append(_direct_prompt_row(cols, r, cand[0]))
                if engine is not None:
                    with ctx.timer("controls"):
                        prompt_rows[-1]["controls"] = composition_controls(
                            model, engine, prompt.ids, pair.chunks, sinks, memo["chunks"],
                            {s: r["variants"].get(variant_name(True, s, 0), {}).get("logprobs") for s in sinks})
                if image is not None:
                    with ctx.timer("image_chunk"):
                        prompt_rows[-1]["image_chunk"] = image_arm(model, prompt.ids, pair.chunks, sinks, image)
        ro, rn = memo[(inst, pair.spec.old)], memo[(inst, pair.spec.new)]
        if not generated:
            rows.append(_direct_pair_row(pair, ro, rn, names, pair.spec.id in flips))
            if arm_seams:
                with ctx.timer("edit_arms"):
                    rows[-1]["arms"] = edit_arms(model, tok, pair, arm_seams, tk, ctx.scenario.chat_template,
                                                 memo.setdefault("arms", {}), rn["full"],
                                                 transcript_turns(ctx.scenario_cfg))
            continue
        missed = [(side, r["full"][0]) for side, r in (("old", ro), ("new", rn)) if not r["full"][0].reached]
        if missed:
            bad_pairs.append({k: x for k, x in pair_row(pair).items() if k in K.EXCLUSION_COLUMNS}
                             | {"reason": K.cot_unreached(ctx, *missed[0])})
        else:
            rows.append(cot_pair_row(pair, ro, rn, names))
    if generated:
        excluded = [*cpairs.excluded, *bad_prompts, *bad_pairs,
                    *({k: r[k] for k in K.EXCLUSION_COLUMNS} for r in rows if not r["flips"])]
        exclusions = K.exclusion_counts(excluded) | ({"beyond_max_pairs": beyond} if beyond else {})
    else:
        excluded, exclusions = fs.excluded, fs.exclusions
    families = families_of(cctx, rows + prompt_rows + bad_prompts)
    with ctx.timer("statistics"):
        agg = aggregate(prompt_rows, rows, names, families, n_boot, ctx.seed, generated)
        arms = aggregate_arms(rows, arm_seams, families, n_boot, ctx.seed) if arm_seams else None
    aggregates = {"n_pairs": len(cpairs.pairs) + len(cpairs.excluded), "n_aligned": len(cpairs.pairs),
                  "n_flip": sum(r["flips"] for r in rows), "n_prompts": len(prompt_rows),
                  "n_owned_prompts": sum(r["owned"] for r in prompt_rows), "families": families, "sinks": sinks,
                  "seams": seams, "variants": agg, "exclusions_by_family": exclusions_by_family(excluded, families),
                  "edit_arm_seams": arm_seams}
    if generated:
        aggregates |= {"readout": "generated", "max_new_tokens": max_new, "n_screened": len(pairs),
                       "n_pair_rows": len(rows), "n_prompts_screened": len(prompt_rows) + len(bad_prompts),
                       "prompt_exclusions": K.exclusion_counts(bad_prompts),
                       "n_unreached": {v: agg[v]["n_unreached"]["all"] for v in names}, "edit_arms": None,
                       "edit_arms_note": EDIT_ARMS_COT_NOTE, "image_chunk": None}
    else:
        aggregates |= {"checks": {"max_abs_logit_diff_full_seam": max(r["max_abs_logit_diff_full_seam"] for r in prompt_rows),
                                  "pairs_with_chunks_tokenised_standalone": sum(all(r["standalone"]) for r in rows),
                                  "n_rows": len(rows)},
                       "edit_arms": arms,
                       "controls": control_summary(prompt_rows, sinks, n_boot, ctx.seed) if engine is not None else None,
                       "image_chunk": None if image is None else image_summary(prompt_rows, image, cpairs, families,
                                                                               n_boot, ctx.seed)}
    return {"rows": rows, "prompts": prompt_rows, "exclusions": exclusions, "excluded": excluded,
            "variant_names": names, "aggregates": aggregates}


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
