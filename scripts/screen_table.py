#!/usr/bin/env python
"""Print the per-family (or per-scenario) screen table of a ``screen`` record as Markdown.

    python -m scripts.screen_table runs/smollm2-135m/screen/default/record.json
    python -m scripts.screen_table runs/smollm2-135m/screen/default/record.json --by scenario
"""

import argparse
import sys


from kvnotes.records import load_record


def fmt_counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("record")
    ap.add_argument("--by", choices=("family", "scenario"), default="family", help="rows of the table")
    args = ap.parse_args()
    rec = load_record(args.record)
    if rec["probe"] != "screen":
        sys.exit(f"kvnotes: error: {args.record} is a '{rec['probe']}' record, not 'screen'")
    table = rec["result"]["aggregates"][f"by_{args.by}"]
    print(f"Model `{rec['model']['name']}`, scenario `{rec['scenario']['name']}` "
          f"({rec['config']['scenario']['n_instances']} instances per scenario, seed {rec['config']['scenario']['seed']}), "
          f"readout `{rec['config']['readout']}`, flip rule `{rec['config'].get('flip_rule', 'relative')}`, "
          f"min_effect {rec['config']['min_effect']} nats.\n")
    print(f"| {args.by} | scenarios | aligned pairs | flipping, relative rule | flipping, owned rule | owned flips when expected (95% Wilson CI) | unexpected flips | not flipping (configured rule) | excluded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fam, t in table.items():
        own = t["owned_when_expected"]
        rate = f"{own['k']}/{own['n']} = {own['p']:.2f} ({own['ci'][0]:.2f}-{own['ci'][1]:.2f})" if own["ci"] else "-"
        print(f"| {fam} | {t['n_scenarios']} | {t['n_pairs']} | {t['n_flip_relative']} | {t['n_flip_owned']} | {rate} "
              f"| {t['unexpected_flips']} | {fmt_counts(t['not_flipping'])} | {fmt_counts(t['excluded'])} |")
    agg = rec["result"]["aggregates"]
    print(f"\nTotal: {agg['n_flip']} flipping of {agg['n_pairs']} aligned pairs, in families {', '.join(agg['flip_families']) or 'none'}.")


if __name__ == "__main__":
    main()
