#!/usr/bin/env python
"""Print the measured serving table of a ``scripts/serve_bench.py`` record as Markdown:
``python -m scripts.serving_table runs/serving/smollm2-135m/default/record.json``.

Every number comes from the record (DESIGN: figures and tables only from records).
"""

import argparse
import sys


from kvnotes.records import load_record


def fmt(x, spec=".2f", none="–") -> str:
    return none if x is None else format(x, spec)


def share(p: dict) -> str:
    if not p or not p.get("n"):
        return "–"
    lo, hi = p["ci"]
    return f"{p['k']}/{p['n']} ({p['p']:.2f} [{lo:.2f}, {hi:.2f}])"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("record")
    args = ap.parse_args()
    try:
        rec = load_record(args.record)
    except (OSError, ValueError) as exc:
        sys.exit(f"kvnotes: error: cannot read record {args.record}: {exc}")
    res = rec["result"]
    print(f"model {rec['model']['name']} · vLLM {rec['packages'].get('vllm')} · block size "
          f"{res['engine']['block_size']} · {rec['scenario']['n_scenarios']} scenarios "
          f"({', '.join(rec['scenario']['families'])}) · {rec['config']['sessions']} sessions x "
          f"{rec['config']['turns']} turns · shared document {rec['config']['doc_tokens']} tokens\n")
    print("| rate (req/s) | field | arm | sent | hit rate (all) | hit rate (updates) | engine hit rate | "
          "TTFT p50 / p90 updates (s) | p90 ratio in_place/arm | throughput (req/s) | owned | "
          "correct (owned) | agreement with harness |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratio = res["aggregates"]["p90_ttft_ratio_vs_in_place"]
    for run in sorted(res["runs"], key=lambda r: (r["rate"], ["early", "middle", "late"].index(r["position"])
                                                   if r["position"] in ("early", "middle", "late") else 9)):
        arm, pos, rate = run["arm"], run["position"], run["rate"]
        r = ratio.get(arm, {}).get(pos, {}).get(str(rate))
        print(f"| {rate:g} | {pos} | {arm} | {run['n_sent']}/{run['n_sent'] + run['n_not_sent']} | "
              f"{fmt(run['hit_rate'], '.3f')} | {fmt(run['hit_rate_updates'], '.3f')} | "
              f"{fmt(run.get('engine_hit_rate'), '.3f')} | {fmt(run['ttft_updates_p50_s'])} / "
              f"{fmt(run['ttft_updates_p90_s'])} | {fmt(r)} | {fmt(run['throughput_rps'], '.3f')} | "
              f"{run['n_owned']}/{run['n_sent']} | {share(run['correct_owned'])} | {share(run['agreement'])} |")
    cc = res["cross_check"]
    print(f"\ncross-check ({len(cc['rows'])} prompts, whole vocabulary): max |Δ log p| candidates "
          f"{cc['max_abs_diff_candidates']:.2e} nats, whole vocabulary {cc['max_abs_diff_vocab']:.2e} nats, "
          f"tolerance {cc['tolerance_nats']:g}, top-1 equal: {cc['all_top1_equal']}")
    diffs = [r["max_abs_diff_candidates"] for r in res["rows"] if r.get("sent")]
    print(f"every served request ({len(diffs)}): max |Δ log p| of the candidates vs the harness "
          f"{max(diffs):.2e} nats")
    cold = [(r["arm"], r["position"], r["rate"]) for r in res["runs"]
            if not (r["reset_ok"] and r["first_request_cached_tokens"] == 0)]
    print(f"cold start: every run reset the prefix cache and its first request had 0 cached tokens: "
          f"{not cold}{'' if not cold else f' (not: {cold})'}")


if __name__ == "__main__":
    main()
