#!/usr/bin/env python
"""Print the table of an ``agent`` record (numbers from the record only).

    python -m scripts.agent_table runs/smollm2-135m/agent/default/record.json
"""

from __future__ import annotations

import json
import sys

SCOPES = (("all", "all turns"), ("turn1", "turn 1"), ("turn2+", "turns 2+"))


def fmt_share(s: dict) -> str:
    """``k/n = mean [interval] (method)`` of a share aggregate; ``-`` without rows."""
    if not s.get("n"):
        return "-"
    ci = s.get("ci_mean")
    method = {"cluster_bootstrap": "", "t_over_scenario_means": " t", "t_over_instance_means": " ti"}.get(
        s.get("ci_method") or "", "")
    # a share lies in [0, 1]: t-intervals over 2-4 cluster means are clipped to it for display
    interval = f" [{max(ci[0], 0.0):.2f}, {min(ci[1], 1.0):.2f}]{method}" if ci else ""
    return f"{s['k']}/{s['n']} = {s['mean']:.2f}{interval}"


def table(record: dict) -> None:
    agg = record["result"]["aggregates"]
    print(f"## {record['model']['name']} · agent · {record['scenario']['name']} · {agg['turns']} turns, seam "
          f"{agg['seam']}, sink {agg['sink']} · {agg['n_trajectories']} trajectories, excluded "
          f"{record['result']['exclusions'] or 0}\n")
    print("| family | turns | agent correct | oracle correct | transcript correct | agent = oracle (oracle owns) "
          "| agent = transcript | KL(oracle‖agent) | time oracle / agent | time transcript / agent |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for fam, scopes in agg["by_family"].items():
        for scope, label in SCOPES:
            a = scopes[scope]
            if not a["n_turns"]:
                continue
            t = a["time"]
            kl = a["kl_oracle"]["mean"]
            print(f"| {fam} | {label} | {fmt_share(a['agent_accuracy'])} | {fmt_share(a['oracle_accuracy'])} | "
                  f"{fmt_share(a['transcript_accuracy'])} | {fmt_share(a['agreement_oracle_owned'])} | "
                  f"{fmt_share(a['agreement_transcript'])} | {'-' if kl is None else f'{kl:.3f}'} | "
                  f"{t['ratio_oracle_over_agent']:.2f} | {t['ratio_transcript_over_agent']:.2f} |")
    print("\nIntervals: means of the 0/1 indicators, 95%: cluster bootstrap with >= 5 scenarios, `t` over "
          "scenario means (2-4), `ti` over instance means (1 scenario); clipped to [0, 1]. Times: sums over the turns "
          f"(device {agg['device']}); chunk precompile excluded "
          f"({agg['by_family']['all']['all']['time']['precompile_ms_total'] / 1e3:.1f} s in all).")


def main() -> None:
    """Print the table of every record path given on the command line."""
    for path in sys.argv[1:]:
        with open(path) as f:
            table(json.load(f))
        print()


if __name__ == "__main__":
    main()
