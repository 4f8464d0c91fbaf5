"""The cells the user-memory experiments' tables share (the ``memory_*`` probes each build theirs in
their own module): the settings line, an arm's cells per memory length (decision agreement, top-1
agreement, accuracy against the full prefill, KL) and the paired tests' cells (McNemar, TOST on
accuracy and KL; Benjamini-Hochberg q values) over persona clusters. Every number comes from the
record.
"""

from __future__ import annotations

from kvnotes.records.tables import CI_MARKS, fmt_kn


def kl_cell(d: dict) -> str:
    """A KL summary to 4 decimals: ``mean [lo, hi] t`` (interval over persona means)."""
    if not d.get("n") or d.get("mean") is None:
        return "-"
    mark = CI_MARKS.get(d.get("ci_method") or "", "")
    if not d.get("ci_mean"):
        return f"{d['mean']:.4f}"
    return f"{d['mean']:.4f} [{d['ci_mean'][0]:.4f}, {d['ci_mean'][1]:.4f}] {mark}".rstrip()


def memory_settings(rec: dict) -> str:
    s = rec["result"]["settings"]
    return (f"model {rec['model']['name']}, memory suite {s['suite_id']} ({len(s['personas'])} personas: "
            f"{', '.join(s['personas'])}), alpha {s['alpha']}, TOST margins: accuracy ±{s['margin_accuracy']}, "
            f"KL ±{s['margin_kl']} nats (clusters = personas); BH over the cells of each test kind\n")


def tests_cells(t: dict) -> str:
    """``McNemar p (q) | TOST acc p (q) equivalent | TOST KL p (q) equivalent`` of one cell."""
    def one(d: dict, eq: bool) -> str:
        if "p" not in d:
            return "n/a"
        out = f"{d['p']:.3g} (q {d['q']:.3g})" if "q" in d else f"{d['p']:.3g}"
        return out + (" ✓" if eq and d.get("equivalent") else (" ✗" if eq else ""))
    mc = t["mcnemar"]
    b_c = f"b={mc['b']}, c={mc['c']}: " if "b" in mc else ""
    return f"{b_c}{one(mc, False)} | {one(t['tost_accuracy'], True)} | {one(t['tost_kl'], True)}"


def arm_cells(s: dict, tests: dict) -> str:
    """The cells of :data:`MEMORY_HEAD` after the memory and arm: agreements, accuracies, KL and tests."""
    return (f"{fmt_kn(s['decision_agreement'])} | {fmt_kn(s['top1_agreement'])} | {fmt_kn(s['accuracy'])} / "
            f"{fmt_kn(s['accuracy_full'])} | {kl_cell(s['kl'])} | {tests_cells(tests)}")


MEMORY_HEAD = ("| memory (tokens) | arm | decision agreement (owned) | top-1 agreement | accuracy arm / full | "
             "KL(full‖arm) mean [95% CI] | McNemar (arm vs full) | TOST accuracy | TOST KL |")
