"""``compose``'s tables: the variant, seam and edit-arm tables of its records, under either readout
(its presentation's ``table``; every number comes from the record)."""

from __future__ import annotations

from kvnotes.records.tables import Lines, fmt, fmt_kn, fmt_counts


def compose_table(rec: dict) -> str:
    """The variant, seam and edit-arm tables of a ``compose`` record."""
    agg = rec["result"]["aggregates"]
    if agg.get("readout") == "generated":
        return _compose_cot_table(rec)
    w = Lines()
    w(f"model {rec['model']['name']}, scenario {rec['scenario']['name']} "
          f"(n_instances {rec['config']['scenario']['n_instances']}): {agg['n_aligned']} aligned pairs, "
          f"{agg['n_prompts']} distinct prompts, {agg['n_owned_prompts']} owned by the full prefill, "
          f"{agg['n_flip']} flipping pairs; check max |logit(full seam) - logit(full)| = "
          f"{agg['checks']['max_abs_logit_diff_full_seam']:.2e}\n")
    w("| variant | decision agreement (owned) | top-1 agreement (all) | KL(full‖composed) mean [95% CI] | recovery mean | logit cosine |")
    w("|---|---|---|---|---|---|")
    for v, d in agg["variants"].items():
        kl = d["kl"]["all"]
        ci = kl.get("ci_mean") or [float("nan")] * 2
        rec_ = d["recovery"]["all"]
        r = "–" if not rec_.get("n") else f"{rec_['mean']:.2f} (n={rec_['n']})"
        w(f"| {v} | {fmt_kn(d['decision_agreement']['all'])} | {fmt_kn(d['top1_agreement']['all'])} | "
              f"{kl['mean']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}] | {r} | {d['logit_cosine']['all']['mean']:.4f} |")
    fams = agg["families"]
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
    return w.text()


def _compose_cot_table(rec: dict) -> str:
    """The variant table of a ``compose`` record under ``scenario.variant=cot`` (decisions read after
    generated chains)."""
    w = Lines()
    agg = rec["result"]["aggregates"]
    w(f"model {rec['model']['name']}, scenario {rec['scenario']['name']}, generated readout (at most "
      f"{agg['max_new_tokens']} new tokens): {agg['n_screened']} of {agg['n_aligned']} aligned pairs screened, "
      f"{agg['n_prompts']} of {agg['n_prompts_screened']} prompts with a full chain that reached its marker, "
      f"{agg['n_owned_prompts']} owned, {agg['n_flip']} generated flips of {agg['n_pair_rows']} pairs · exclusions "
      f"{fmt_counts(rec['result']['exclusions'])}\n")
    w("| variant | decision agreement (owned) | top-1 agreement (all) | same chain | KL(full‖composed) mean | "
      "new decision (flips) | unreached |")
    w("|---|---|---|---|---|---|---|")
    for v, d in agg["variants"].items():
        kl = d["kl"]["all"].get("mean")
        w(f"| {v} | {fmt_kn(d['decision_agreement']['all'])} | {fmt_kn(d['top1_agreement']['all'])} | "
          f"{fmt_kn(d['same_chain']['all'])} | {fmt(kl, '.4f')} | {fmt_kn(d['new_decision']['all'])} | "
          f"{d['n_unreached']['all']} |")
    if agg.get("edit_arms_note"):
        w(f"\n{agg['edit_arms_note']}")
    return w.text()
