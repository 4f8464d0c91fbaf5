#!/usr/bin/env python
"""Markdown tables of a ``compose`` record (numbers from the record only).

    python scripts/compose_table.py runs/smollm2-135m/compose/small/record.json
"""

from __future__ import annotations

import json
import sys


def fmt(p: dict) -> str:
    return "–" if not p.get("n") else f"{p['p']:.2f} ({p['k']}/{p['n']})"


def main() -> None:
    rec = json.load(open(sys.argv[1]))
    agg = rec["result"]["aggregates"]
    print(f"model {rec['model']['name']}, scenario {rec['scenario']['name']} "
          f"(n_instances {rec['config']['scenario']['n_instances']}): {agg['n_aligned']} aligned pairs, "
          f"{agg['n_prompts']} distinct prompts, {agg['n_owned_prompts']} owned by the full prefill, "
          f"{agg['n_flip']} flipping pairs; check max |logit(full seam) - logit(full)| = "
          f"{agg['checks']['max_abs_logit_diff_full_seam']:.2e}\n")
    print("| variant | decision agreement (owned) | top-1 agreement (all) | KL(full‖composed) mean [95% CI] | recovery mean | logit cosine |")
    print("|---|---|---|---|---|---|")
    for v, d in agg["variants"].items():
        kl = d["kl"]["all"]
        ci = kl.get("ci_mean") or [float("nan")] * 2
        rec_ = d["recovery"]["all"]
        r = "–" if not rec_.get("n") else f"{rec_['mean']:.2f} (n={rec_['n']})"
        print(f"| {v} | {fmt(d['decision_agreement']['all'])} | {fmt(d['top1_agreement']['all'])} | "
              f"{kl['mean']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}] | {r} | {d['logit_cosine']['all']['mean']:.4f} |")
    fams = agg["families"]
    print("\nDecision agreement on owned prompts per family (rotate/sink=bos vs no_rotate/sink=bos):\n")
    print("| seam | " + " | ".join(f"{f} rotate | {f} no_rotate" for f in fams) + " |")
    print("|---|" + "---|" * (2 * len(fams)))
    for s in agg["seams"]:
        cells = []
        for f in fams:
            for r in ("rotate", "no_rotate"):
                cells.append(fmt(agg["variants"][f"{r}/sink=bos/seam={s}"]["decision_agreement"][f]))
        print(f"| {s} | " + " | ".join(cells) + " |")
    arms = agg.get("edit_arms")
    if arms:
        print("\nEdits inside a composition, judged against a full prefill of the edited text:\n")
        print("| arm | method | agreement with oracle (owned) | accuracy (new value's candidate top-1) | KL(oracle‖method) mean |")
        print("|---|---|---|---|---|")
        for arm, d in arms.items():
            for k, m in d.items():
                if isinstance(m, dict):
                    kl = m["kl"]["mean"]
                    print(f"| {arm} (n={d['n']}, excluded {d['excluded']}) | {k} | {fmt(m['agreement_owned'])} | "
                          f"{fmt(m['accuracy'])} | {'–' if kl is None else f'{kl:.3f}'} |")


if __name__ == "__main__":
    main()
