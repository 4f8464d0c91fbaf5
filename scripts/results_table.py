#!/usr/bin/env python
"""Per-family results table (Markdown) from the records of one model and scenario suite.

    python -m scripts.results_table runs/smollm2-135m --suite small

Reads whichever of the ``screen``, ``field_refresh``, ``suffix_recovery`` and ``injection``
records exist under ``<dir>/<probe>/<suite>/record.json``; a missing record leaves its columns
empty. Every number is read from a record.
"""

import argparse
import sys
from pathlib import Path


from kvnotes.records import load_record
from kvnotes.tables import ci


def share(d: dict | None) -> str:
    return f"{d['k']}/{d['n']}" if d else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model_dir", help="runs/<model>")
    ap.add_argument("--suite", default="default")
    args = ap.parse_args()
    recs = {}
    for probe in ("screen", "field_refresh", "suffix_recovery", "injection"):
        p = Path(args.model_dir) / probe / args.suite / "record.json"
        if p.is_file():
            recs[probe] = load_record(p)
    if not recs:
        sys.exit(f"kvnotes: error: no records under {args.model_dir}/*/{args.suite}")
    fams = set()
    for r in recs.values():
        fams |= {row["family"] for row in r["result"]["rows"]}
    sr = recs.get("suffix_recovery")
    if sr:
        grid = [(g["kind"], g["value"]) for g in sr["result"]["grid"]]
        i10, i1 = grid.index(("fraction", 0.1)), grid.index(("count", 1))
    print("| family | flipping / aligned pairs | field-only refresh | downstream only | last 10% of downstream (held-out) "
          "| top-1 position (held-out) | k-matched random position (held-out) | notes injected: decision follows notes |")
    print("|---|---|---|---|---|---|---|---|")
    for fam in sorted(fams) + ["all"]:
        cells = [fam]
        scr = recs.get("screen")
        t = scr["result"]["aggregates"]["by_family"].get(fam) if scr else None
        if scr and fam == "all":
            a = scr["result"]["aggregates"]
            cells.append(f"{a['n_flip']}/{a['n_pairs']}")
        else:
            cells.append(f"{t['n_flip']}/{t['n_pairs']}" if t else "-")
        fr = recs.get("field_refresh")
        rec = fr["result"]["aggregates"]["recovery"] if fr else {}
        cells += [ci(rec.get("field", {}).get(fam)), ci(rec.get("downstream", {}).get(fam))]
        if sr:
            cur = sr["result"]["aggregates"]["curves"]["heldout"]
            cells += [ci(cur["suffix"][i10].get(fam)), ci(cur["topk"][i1].get(fam)), ci(cur["random"][i1].get(fam))]
        else:
            cells += ["-"] * 3
        inj = recs.get("injection")
        f = inj["result"]["aggregates"]["flipping"].get(fam) if inj else None
        cells.append(share(f["old_notes_into_new"]["follow_notes"]) + " / " + share(f["new_notes_into_old"]["follow_notes"])
                     if f else "-")
        print("| " + " | ".join(cells) + " |")
    print("\nIntervals: 95% two-stage cluster bootstrap with >= 5 scenarios; `t` = t-interval over scenario "
          "means (2-4 scenarios); `ti` = t-interval over instance means (1 scenario); none for a single cluster.")


if __name__ == "__main__":
    main()
