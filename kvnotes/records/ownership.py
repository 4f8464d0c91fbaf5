"""Which decisions the model owns, read from a ``screen`` record: per scenario, the expected-flip
pairs whose clean runs' top-1 tokens are their expected candidates, and each miss's top-1 token
(``docs/design.md``, "Decision ownership"). What ``kvnotes ownership-scan`` prints and writes.
"""

from __future__ import annotations


def ownership(rec: dict) -> dict[str, dict]:
    """Per scenario of a screen record: ``family``, ``expected`` (expected-flip pairs), ``owned`` (of
    those, flipping under the ``owned`` rule), ``flip`` (flipping under the ``relative`` rule),
    ``excluded`` (pairs not token-aligned) and ``misses``: for each clean run of an expected-flip pair
    whose vocabulary top-1 is not its expected candidate, that token, its probability and the
    candidates' probability mass. What ``kvnotes ownership-scan`` prints."""
    out: dict[str, dict] = {}

    def entry(row: dict) -> dict:
        return out.setdefault(row["scenario"], {"family": row["family"], "expected": 0, "owned": 0, "flip": 0,
                                                "excluded": 0, "misses": []})

    for ex in rec["result"].get("excluded") or []:
        entry(ex)["excluded"] += 1
    for row in rec["result"]["rows"]:
        e = entry(row)
        if not row["expect_flip"]:
            continue
        e["expected"] += 1
        e["owned"] += bool(row["flips_owned"])
        e["flip"] += bool(row["flips_relative"])
        for run in ("old", "new"):
            if row.get(f"owns_{run}") is False:
                e["misses"].append(f"{row['pair']} {run}: top1 {row[f'top1_{run}']!r} p={row[f'p_top1_{run}']:.3f}; "
                                   f"candidates' mass {row[f'cand_mass_{run}']:.4f}")
    return out


def ownership_lines(rec: dict, quiet: bool = False) -> list[str]:
    """:func:`ownership` as text: a line per scenario (by family), its misses unless ``quiet``, and a
    line per family."""
    per = ownership(rec)
    lines, fam = [], {}
    for sid, r in sorted(per.items(), key=lambda kv: (kv[1]["family"], kv[0])):
        f = fam.setdefault(r["family"], [0, 0, 0])
        f[0], f[1], f[2] = f[0] + r["owned"], f[1] + r["flip"], f[2] + r["expected"]
        lines.append(f"{r['family']:10s} {sid:22s} owned {r['owned']:2d}/{r['expected']:2d}  flip {r['flip']:2d}  "
                     f"excluded {r['excluded']}")
        lines += [] if quiet else ["    " + m for m in sorted(set(r["misses"]))]
    lines += [f"FAMILY {name}: owned {o}/{e} ({o / max(e, 1):.0%}), flipping {fl}/{e}" for name, (o, fl, e) in fam.items()]
    return lines
