#!/usr/bin/env python
"""Field-only vs downstream recovery of a ``field_refresh`` record, restricted to OWNED pairs.

A pair is owned when the ``screen`` record of the same model and suite says it flips and
``own_answer`` is true (each clean run's whole-vocabulary top-1 token is its expected candidate's
first token). Recovery ``r = (s_patched - s_old) / (s_new - s_old)`` (paper §3; unclipped) is
summarised per family with :func:`kvnotes.probing.recovery_summary` (cluster bootstrap over
scenarios, then instances). Prints a Markdown table.

    python scripts/owned_recovery.py runs/smollm2-135m/screen/default/record.json \\
        runs/smollm2-135m/field_refresh/default/record.json
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvnotes.probing import recovery_summary  # noqa: E402
from kvnotes.records import load_record  # noqa: E402


def fmt(s: dict) -> str:
    if not s["n"]:
        return "-"
    ci = s["ci_mean"]
    ci_txt = f" ({ci[0]:.2f} to {ci[1]:.2f})" if ci else ""
    return f"{s['mean']:.2f}{ci_txt}, median {s['median']:.2f}"


def share(s: dict) -> str:
    d = s.get("decision_flipped") or {}
    return f"{d.get('k', '?')}/{d.get('n', '?')}" if d else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("screen")
    ap.add_argument("field_refresh")
    ap.add_argument("--n-boot", type=int, default=2000)
    args = ap.parse_args()
    screen, refresh = load_record(args.screen), load_record(args.field_refresh)
    for rec, probe in ((screen, "screen"), (refresh, "field_refresh")):
        if rec["probe"] != probe:
            sys.exit(f"kvnotes: error: expected a '{probe}' record, got '{rec['probe']}'")
    owned = {r["pair"] for r in screen["result"]["rows"] if r["flips"] and r["own_answer"]}
    rows = [r for r in refresh["result"]["rows"] if r["pair"] in owned]
    print(f"Model `{refresh['model']['name']}`, scenario `{refresh['scenario']['name']}`: "
          f"{len(rows)} owned pairs of {len(refresh['result']['rows'])} flipping pairs in the field_refresh record.\n")
    print("| family | owned pairs | r field only: mean (95% CI), median | patch flips decision | "
          "r downstream only: mean (95% CI), median | patch flips decision |")
    print("|---|---|---|---|---|---|")
    for fam in ["all", *sorted({r["family"] for r in rows})]:
        rs = rows if fam == "all" else [r for r in rows if r["family"] == fam]
        f = recovery_summary(rs, "r_field", "flipped_field", args.n_boot)
        d = recovery_summary(rs, "r_downstream", "flipped_downstream", args.n_boot)
        print(f"| {fam} | {len(rs)} | {fmt(f)} | {share(f)} | {fmt(d)} | {share(d)} |")


if __name__ == "__main__":
    main()
