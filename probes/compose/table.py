"""``compose``'s tables: the variant, seam and edit-arm tables of its records, under either readout
(its presentation's ``table``; every number comes from the record, every column it has)."""

from __future__ import annotations

from kvnotes.records.tables import Lines, fmt, fmt_kn, fmt_counts


def _header(rec: dict) -> str:
    """The record's counts: pairs, prompts, flips, the readout and the exclusions."""
    agg = rec["result"]["aggregates"]
    read = (f"generated readout (at most {agg['max_new_tokens']} new tokens), {agg['n_screened']} of "
            f"{agg['n_aligned']} aligned pairs screened" if "max_new_tokens" in agg else
            f"{agg['n_aligned']} aligned pairs")
    check = agg["checks"].get("max_abs_logit_diff_full_seam")
    return (f"model {rec['model']['name']}, scenario {rec['scenario']['name']} "
            f"(n_instances {rec['config']['scenario']['n_instances']}), {read}: {agg['n_prompts']} of "
            f"{agg['n_prompts_screened']} distinct prompts read, {agg['n_owned_prompts']} owned by the full prefill, "
            f"{agg['n_flip']} flipping pairs of {agg['checks']['n_rows']} · exclusions "
            f"{fmt_counts(rec['result']['exclusions'])}"
            + ("" if check is None else f"; check max |logit(full seam) - logit(full)| = {check:.2e}") + "\n")


def compose_table(rec: dict) -> str:
    """The variant, seam and edit-arm tables of a ``compose`` record; the logit cosine where the
    record has it (direct readout), whether the composed chain is the full one where there are chains."""
    agg = rec["result"]["aggregates"]
    w = Lines()
    w(_header(rec))
    some = next(iter(agg["variants"].values()), {})
    cosine, chains = "logit_cosine" in some, "same_chain" in some
    w("| variant | decision agreement (owned) | top-1 agreement (all) | KL(full‖composed) mean [95% CI] | "
      "recovery mean | new decision (flips) | unreached |" + (" logit cosine |" if cosine else "")
      + (" same chain |" if chains else ""))
    w("|---|---|---|---|---|---|---|" + ("---|" if cosine else "") + ("---|" if chains else ""))
    for v, d in agg["variants"].items():
        kl = d["kl"]["all"]
        ci = kl.get("ci_mean") or [float("nan")] * 2
        rec_ = d["recovery"]["all"]
        r = "–" if not rec_.get("n") else f"{rec_['mean']:.2f} (n={rec_['n']})"
        w(f"| {v} | {fmt_kn(d['decision_agreement']['all'])} | {fmt_kn(d['top1_agreement']['all'])} | "
          f"{fmt(kl.get('mean'), '.4f')} [{ci[0]:.4f}, {ci[1]:.4f}] | {r} | {fmt_kn(d['new_decision']['all'])} | "
          f"{d['n_unreached']['all']} |" + (f" {fmt(d['logit_cosine']['all'].get('mean'), '.4f')} |" if cosine else "")
          + (f" {fmt_kn(d['same_chain']['all'])} |" if chains else ""))
    fams = agg["families"]
    if "bos" in agg["sinks"]:
        w("\nDecision agreement on owned prompts per family (rotate/sink=bos vs no_rotate/sink=bos):\n")
        w("| seam | " + " | ".join(f"{f} rotate | {f} no_rotate" for f in fams) + " |")
        w("|---|" + "---|" * (2 * len(fams)))
        for s in agg["seams"]:
            cells = []
            for f in fams:
                for r in ("rotate", "no_rotate"):
                    cells.append(fmt_kn(agg["variants"][f"{r}/sink=bos/seam={s}"]["decision_agreement"][f]))
            w(f"| {s} | " + " | ".join(cells) + " |")
    arms = agg.get("edit_arms")
    if arms:
        w("\nEdits inside a composition, judged against a full prefill of the edited text:\n")
        w("| arm | method | agreement with oracle (owned) | accuracy (new value's candidate top-1) | KL(oracle‖method) mean |")
        w("|---|---|---|---|---|")
        for arm, d in arms.items():
            for k, m in d.items():
                if isinstance(m, dict):
                    kl = m["kl"]["mean"]
                    w(f"| {arm} (n={d['n']}, excluded {d['excluded']}) | {k} | {fmt_kn(m['agreement_owned'])} | "
                      f"{fmt_kn(m['accuracy'])} | {'–' if kl is None else f'{kl:.3f}'} |")
    elif agg.get("edit_arms_note"):
        w(f"\n{agg['edit_arms_note']}")
    return w.text()
