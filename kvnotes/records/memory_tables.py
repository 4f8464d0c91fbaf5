"""Tables of the user-memory experiments' records (the ``memory_*`` probes) as Markdown: per
memory length and arm, decision agreement, top-1 agreement, accuracy against the full prefill, KL,
and the paired tests (McNemar, TOST on accuracy and KL; Benjamini-Hochberg q values) over persona
clusters. Every number comes from the record; the probes name these functions in their
presentation (:mod:`kvnotes.records.presentation`), as :mod:`kvnotes.records.tables` does for the rest.
"""

from __future__ import annotations

from kvnotes.records.tables import CI_MARKS, _Lines, fmt, fmt_counts, fmt_kn


def _kl(d: dict) -> str:
    """A KL summary to 4 decimals: ``mean [lo, hi] t`` (interval over persona means)."""
    if not d.get("n") or d.get("mean") is None:
        return "-"
    mark = CI_MARKS.get(d.get("ci_method") or "", "")
    if not d.get("ci_mean"):
        return f"{d['mean']:.4f}"
    return f"{d['mean']:.4f} [{d['ci_mean'][0]:.4f}, {d['ci_mean'][1]:.4f}] {mark}".rstrip()


def _memory_settings(rec: dict) -> str:
    s = rec["result"]["settings"]
    return (f"model {rec['model']['name']}, memory suite {s['suite_id']} ({len(s['personas'])} personas: "
            f"{', '.join(s['personas'])}), alpha {s['alpha']}, TOST margins: accuracy ±{s['margin_accuracy']}, "
            f"KL ±{s['margin_kl']} nats (clusters = personas); BH over the cells of each test kind\n")


def _tests_cells(t: dict) -> str:
    """``McNemar p (q) | TOST acc p (q) equivalent | TOST KL p (q) equivalent`` of one cell."""
    def one(d: dict, eq: bool) -> str:
        if "p" not in d:
            return "n/a"
        out = f"{d['p']:.3g} (q {d['q']:.3g})" if "q" in d else f"{d['p']:.3g}"
        return out + (" ✓" if eq and d.get("equivalent") else (" ✗" if eq else ""))
    mc = t["mcnemar"]
    b_c = f"b={mc['b']}, c={mc['c']}: " if "b" in mc else ""
    return f"{b_c}{one(mc, False)} | {one(t['tost_accuracy'], True)} | {one(t['tost_kl'], True)}"


def _arm_cells(s: dict, tests: dict) -> str:
    """The cells of :data:`_MEM_HEAD` after the memory and arm: agreements, accuracies, KL and tests."""
    return (f"{fmt_kn(s['decision_agreement'])} | {fmt_kn(s['top1_agreement'])} | {fmt_kn(s['accuracy'])} / "
            f"{fmt_kn(s['accuracy_full'])} | {_kl(s['kl'])} | {_tests_cells(tests)}")


_MEM_HEAD = ("| memory (tokens) | arm | decision agreement (owned) | top-1 agreement | accuracy arm / full | "
             "KL(full‖arm) mean [95% CI] | McNemar (arm vs full) | TOST accuracy | TOST KL |")


def memory_transplant_table(rec: dict) -> str:
    """E2: per length and arm, agreement with the full prefill, KL and the paired tests."""
    w = _Lines()
    res = rec["result"]
    w(_memory_settings(rec))
    w(_MEM_HEAD)
    w("|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for arm in res["arm_names"]:
            s = a["arms"][arm]
            w(f"| {L} ({a['memory_tokens_mean']:.0f}) | {arm} | {_arm_cells(s, res['tests'][f'{L}/{arm}'])} |")
    w("\n| memory (tokens) | full prefill s | precompile (once) s | " + " | ".join(f"splice {a} s" for a in res["arm_names"]) + " |")
    w("|---|---|---|" + "---|" * len(res["arm_names"]))
    for L, a in res["aggregates"].items():
        w(f"| {L} | {a['full_s_mean']:.2f} | {a['precompile_s_mean']:.2f} | "
          + " | ".join(f"{a['compose_s_mean'][n]:.3f}" for n in res["arm_names"]) + " |")
    return w.text()


def memory_edits_table(rec: dict) -> str:
    """E3: per length and arm, agreement with the full re-prefill, KL, cost and the paired tests."""
    w = _Lines()
    res = rec["result"]
    w(_memory_settings(rec))
    w(f"recompile_chunk had the full prompt's exact tokens in {res['checks']['recompile_same_tokens']}/"
      f"{res['checks']['n_rows']} rows\n")
    w(_MEM_HEAD + " tokens / full | time / full | applied |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for arm in res["arm_names"]:
            s = a["arms"][arm]
            w(f"| {L} | {arm} | {_arm_cells(s, res['tests'][f'{L}/{arm}'])} | {s['token_ratio_mean']:.4f} | "
              f"{s['time_ratio_mean']:.3f} | "
              f"{fmt_counts(s['applied'])} |")
    w("\n| memory | full re-prefill tokens | full re-prefill s | stale arm still names the old answer |")
    w("|---|---|---|---|")
    for L, a in res["aggregates"].items():
        w(f"| {L} | {a['full_tokens_mean']:.0f} | {a['full_s_mean']:.2f} | {a['stale_owned_old']}/{a['n']} |")
    return w.text()


def memory_granularity_table(rec: dict) -> str:
    """E4: per length and S, composition and localized-edit agreement with full, cost, and the
    cross-referential split."""
    w = _Lines()
    res = rec["result"]
    w(_memory_settings(rec))
    w(_MEM_HEAD + " precompile s (all blocks) |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for S, s in a["by_S"].items():
            w(f"| {L} | S={S} | {_arm_cells(s, res['tests'][f'{L}/S={S}'])} | {s['precompile_s_mean']:.2f} |")
    w("\nLocalized edit (only the block holding the changed fact recompiled), against the full re-prefill "
      "of the edited memory:\n")
    w(_MEM_HEAD + " edit tokens / full | edit time / full |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for S, s in a["edit_by_S"].items():
            w(f"| {L} | S={S} | {_arm_cells(s, res['tests'][f'{L}/edit/S={S}'])} | {s['token_ratio_mean']:.4f} | "
              f"{s['time_ratio_mean']:.3f} |")
    w("\nCross-referential queries (two linked facts) with the facts in one block vs split across two:\n")
    w("| memory | S | together: top-1 agreement | together: accuracy | together: KL mean | split: top-1 agreement "
      "| split: accuracy | split: KL mean | McNemar together vs split |")
    w("|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for S, c in a["cross"].items():
            t, s, m = c["together"], c["split"], c["mcnemar_together_vs_split"]
            mc = f"b={m['b']}, c={m['c']}, p={m['p']:.3g}" if "p" in m else "n/a"
            w(f"| {L} | {S} | {fmt_kn(t['top1_agreement'])} | {fmt_kn(t['accuracy'])} | {fmt(t['kl_mean'], '.4f')} | "
              f"{fmt_kn(s['top1_agreement'])} | {fmt_kn(s['accuracy'])} | {fmt(s['kl_mean'], '.4f')} | {mc} |")
    return w.text()


def memory_agent_table(rec: dict) -> str:
    """E5: per run (timed sessions, long horizon), length and arm: agreement with the re-prefill of
    the rewritten prompt, KL, cumulative time to first token against re-prefilling every turn, the
    paired tests, and the long horizon's KL slope over turns."""
    w = _Lines()
    res = rec["result"]
    w(_memory_settings(rec))
    w("| run / memory (tokens) | turns | arm | decision agreement (owned) | top-1 agreement | accuracy arm / full | "
      "KL(full‖arm) mean [95% CI] | McNemar (arm vs full) | TOST accuracy | TOST KL | cumulative TTFT s "
      "(re-prefill s) | re-prefill / arm | KL slope per turn (p) | applied |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cell, a in res["aggregates"].items():
        for arm in res["arm_names"]:
            s = a["arms"][arm]
            dr = s.get("drift")
            slope = "n/a" if not dr or dr["kl_slope"] is None else f"{dr['kl_slope']:+.2e} ({dr['kl_slope_p']:.2g})"
            w(f"| {cell} ({a['prompt_tokens_mean']:.0f}) | {a['turns']} | {arm} | "
              f"{_arm_cells(s, res['tests'][f'{cell}/{arm}'])} | {s['cum_ttft_s']:.2f} "
              f"({a['cum_ttft_full_s']:.2f}) | {fmt(s['cum_ttft_ratio'], '.2f')}x | {slope} | {fmt_counts(s['applied'])} |")
    return w.text()


def memory_placement_table(rec: dict) -> str:
    """E1: per length and integration depth, accuracy with the memory early vs late, the answer's
    log-prob, KL(early‖late) and the paired tests of late against early."""
    w = _Lines()
    res = rec["result"]
    w(_memory_settings(rec))
    w("Reference = early ([prefix | memory | document | query]), arm = late ([prefix | document | memory | query]); "
      "McNemar b = late right and early wrong, c = the reverse\n")
    w("| memory (tokens) | document | depth (facts) | accuracy early | accuracy late | late − early | "
      "answer log-prob early / late | top-1 agreement | KL(early‖late) mean [95% CI] | McNemar (late vs early) | "
      "TOST accuracy | TOST KL |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for L, a in res["aggregates"].items():
        for d, s in a["by_depth"].items():
            lp = s["answer_logprob"]
            w(f"| {L} ({a['memory_tokens_mean']:.0f}) | {a['document_tokens_mean']:.0f} | {d} | "
              f"{fmt_kn(s['accuracy_early'])} | {fmt_kn(s['accuracy_late'])} | {fmt(s['difference'], '+.2f')} | "
              f"{fmt(lp['early'].get('mean'), '.2f')} / {fmt(lp['late'].get('mean'), '.2f')} | "
              f"{fmt_kn(s['top1_agreement'])} | {_kl(s['kl'])} | {_tests_cells(res['tests'][f'{L}/depth={d}'])} |")
    w("\n| memory (tokens) | prompt tokens (mean) | prefill early s | prefill late s |")
    w("|---|---|---|---|")
    for L, a in res["aggregates"].items():
        w(f"| {L} | {a['prompt_tokens_mean']:.0f} | {a['prefill_s_mean']['early']:.2f} | "
          f"{a['prefill_s_mean']['late']:.2f} |")
    return w.text()
