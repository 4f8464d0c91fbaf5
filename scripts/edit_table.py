#!/usr/bin/env python
"""Print the tables of an ``edit`` record (numbers from the record only).

    python scripts/edit_table.py runs/smollm2-135m/edit/small/record.json [...cot record]
"""

from __future__ import annotations

import json
import sys


def fmt_p(p: dict) -> str:
    if not p or p.get("p") is None:
        return "n/a"
    ci = p.get("ci")
    return f"{p['p']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] (n={p['n']})" if ci else f"{p['p']:.2f} (n={p['n']})"


def fmt(v, spec=".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def table(record: dict) -> None:
    agg = record["result"]["aggregates"]
    variant = agg.get("variant", "direct")
    print(f"## {record['model']['name']} · edit · {record['scenario']['name']} · {variant} · "
          f"n_flip={agg['n_flip']} · exclusions {record['result']['exclusions']}\n")
    if variant == "cot":
        print("| method | agrees with full (Wilson 95%) | reached marker | tokens recomputed / total |")
        print("|---|---|---|---|")
        for name, m in agg["methods"].items():
            print(f"| {name} | {fmt_p(m['agreement']['all'])} | {fmt_p(m['reached_marker'])} | "
                  f"{fmt(m['frac']['all']['mean'])} |")
        print(f"\ncontrols (moved the stale decision): "
              + ", ".join(f"{k} {fmt_p(v)}" for k, v in agg["controls"].items()))
        return
    print("| method | agrees with full (Wilson 95%) | mean recovery | KL(full‖m) nats | top-1 = full | "
          "tokens / total | FLOPs / full | time / full (median) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = list(agg["methods"].items())
    rows += [(n, m) for n, m in agg["sweep"].items()]
    for name, m in rows:
        rec = m["recovery"]["all"]
        print(f"| {name} | {fmt_p(rec.get('decision_flipped'))} | {fmt(rec['mean'], '.2f')} | "
              f"{fmt(m['kl']['all']['mean'])} | {fmt_p(m['top1']['all'])} | {fmt(m['frac']['all']['mean'])} | "
              f"{fmt(m['flops_frac']['all']['mean'])} | {fmt(m['time_ratio']['all']['median'], '.2f')} |")
    c = agg["controls"]
    print(f"\ncontrols (moved the stale decision): wrong_erratum {fmt_p(c['wrong_erratum']['all'])}, "
          f"irrelevant_notice {fmt_p(c['irrelevant_notice']['all'])}; over-correction (correct erratum flips "
          f"a same-decision control pair): {fmt_p(c['overcorrection'])}")
    ch = agg["ranking_choice"]
    print(f"\nranking chosen on selection instances: {ch['chosen']} (selection mean agreement over K: "
          f"{ {k: (None if v is None else round(v, 3)) for k, v in ch['selection_score'].items()} }); held-out agreement "
          f"by K: " + ", ".join(f"{k}: {fmt_p(p)}" for k, p in (ch["held_out"].get(ch["chosen"]) or {}).items()))


if __name__ == "__main__":
    for path in sys.argv[1:]:
        table(json.load(open(path)))
        print()
