"""Tables of records as Markdown, one implementation for ``kvnotes table`` and the HTML report
(:mod:`kvnotes.records.report`): every number comes from the record. A probe names its table in
its presentation (``PRESENTATION.table``, :mod:`kvnotes.records.presentation`; a probe's table lives
in its own module, built from the formatters here); probes without one get :func:`aggregates_table`.
:func:`results_table` joins the records of one model and suite into the paper's per-family results
table, each record adding the columns its presentation declares (``PRESENTATION.results``).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np

from kvnotes.records.presentation import presentation

class Lines:
    """Collects printed lines (``print`` semantics: one call, one line)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        self.lines.append(text)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def fmt_counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def fmt_p(p: dict) -> str:
    if not p or p.get("p") is None:
        return "n/a"
    ci = p.get("ci")
    return f"{p['p']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] (n={p['n']})" if ci else f"{p['p']:.2f} (n={p['n']})"


def fmt(v, spec=".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def fmt_kn(p: dict) -> str:
    return "–" if not p.get("n") else f"{p['p']:.2f} ({p['k']}/{p['n']})"


#: Short marks of the interval methods (``kvnotes.harness.stats.summarize`` ``ci_method``).
CI_MARKS = {"cluster_bootstrap": "", "t_over_scenario_means": "t", "t_over_instance_means": "ti",
            "none_single_cluster": "1 cluster"}


def ci(d: dict | None) -> str:
    """``mean [lo, hi]`` with a mark of the interval's method; no interval for a single cluster;
    a family mean whose scenarios disagree (``disagree``, :func:`kvnotes.harness.kit.scenario_breakdown`)
    is flagged with the two scenarios' means."""
    if not d or d.get("mean") is None:
        return "-"
    mark = CI_MARKS.get(d.get("ci_method") or "cluster_bootstrap", d.get("ci_method"))
    if not d.get("ci_mean"):
        return f"{d['mean']:.2f} ({mark or 'no interval'})" + disagreement(d)
    lo, hi = d["ci_mean"]
    return (f"{d['mean']:.2f} [{lo:.2f}, {hi:.2f}]{' ' + mark if mark else ''} (n={d['n']}, {d['n_scenarios']} sc.)"
            + disagreement(d))


def disagreement(d: dict) -> str:
    """`` ⚠ scenarios disagree: a 0.95 vs b 0.30`` for a family mean whose scenarios' intervals do not
    overlap (``d["disagree"]``), else ``""``."""
    if not d.get("disagree"):
        return ""
    a, b = d["disagree"]
    per = d["by_scenario"]
    return f" ⚠ scenarios disagree: {a} {per[a]['mean']:.2f} vs {b} {per[b]['mean']:.2f}"


def summaries(tree, path: tuple = ()) -> list[tuple[str, dict]]:
    """Every summary (a mapping with ``mean`` and ``n``) under an aggregates tree, with its path."""
    if isinstance(tree, dict):
        if "mean" in tree and "n" in tree:
            scalar = tree["mean"] is None or isinstance(tree["mean"], (int, float))
            return [("/".join(path), tree)] if scalar else []
        return [x for k, v in tree.items() for x in summaries(v, path + (str(k),))]
    return []


def aggregates_table(rec: dict, limit: int = 60) -> str:
    """Every summary aggregate of a record (``mean [interval] method (n, scenarios)``), by path."""
    w = Lines()
    rows = [(p, s) for p, s in summaries(rec["result"].get("aggregates", {})) if s.get("n")]
    w(f"{len(rows)} aggregates with pairs (flip rule `{rec['config'].get('flip_rule')}`)"
      + (f"; the first {limit}:" if len(rows) > limit else ":") + "\n")
    w("| aggregate | mean [95% interval] (n, scenarios) | median | interval method |")
    w("|---|---|---|---|")
    for path, s in rows[:limit]:
        med = s.get("median")
        w(f"| {path} | {ci(s)} | {'-' if med is None else f'{med:.3f}'} | {s.get('ci_method') or '-'} |")
        for sc, sub in (s.get("by_scenario") or {}).items():
            w(f"| &nbsp;&nbsp;{path} · {sc} | {ci(sub | {'n_scenarios': 1})} | - | {sub.get('ci_method') or '-'} |")
    return w.text()


def record_table(rec: dict, **options) -> str:
    """The table of a record: the one its probe's presentation names
    (:func:`kvnotes.records.presentation.presentation`), else :func:`aggregates_table`; then, when
    the record has verdicts (``aggregates.verdicts``), :func:`verdicts_table`.

    Args:
        options: keyword options of the probe's table it accepts (e.g. ``by`` of
            a screen table); the others are ignored.
    """
    fn = presentation(rec).table or aggregates_table
    params = inspect.signature(fn).parameters
    return fn(rec, **{k: v for k, v in options.items() if k in params}) + verdicts_table(rec)


def verdict_summary(rec: dict) -> str:
    """One line of a record's verdicts over all its pairs (``name: verdict``; ``""`` without any),
    for the report's index."""
    return "; ".join(f"{name}: {v['by_family']['all']['verdict']}"
                     for name, v in rec["result"].get("aggregates", {}).get("verdicts", {}).items())


def verdicts_table(rec: dict) -> str:
    """Each verdict of a record (``aggregates.verdicts``, :func:`kvnotes.harness.kit.verdicts`): does
    the selected result beat its control on held-out pairs, per family and per scenario, with the
    numbers that say why (the selected and control means, the paired difference's interval and
    method, scenarios that disagree); ``""`` when the record has none."""
    verdicts = rec["result"].get("aggregates", {}).get("verdicts") or {}
    if not verdicts:
        return ""
    w = Lines()
    for name, v in verdicts.items():
        w(f"\n**Verdict `{name}`**: {v['claim']}.\n")
        w("| family / scenario | verdict | selected | control | difference [95% interval] | why |")
        w("|---|---|---|---|---|---|")
        for fam, cell in v["by_family"].items():
            rows = [(f"**{fam}**", cell)] + [(f"&nbsp;&nbsp;{sc}", c) for sc, c in cell.get("scenarios", {}).items()]
            for label, c in rows:
                if not c["difference"].get("n"):
                    w(f"| {label} | {c['verdict']} | - | - | - | no held-out pairs |")
                    continue
                why = c.get("reason", "")
                w(f"| {label} | {c['verdict']} | {fmt(c['selected']['mean'])} | {fmt(c['control']['mean'])} | "
                  f"{ci(c['difference'])} | {why if label.startswith('**') else ''} |")
    return w.text()


def serving_table(rec: dict) -> str:
    """The measured serving table of a ``kvnotes serve-bench`` (:mod:`kvnotes.cli.serve_bench`) record (per rate, field position
    and arm: hit rates, time to first token on update turns, correctness against the harness)."""
    w = Lines()
    res = rec["result"]
    w(f"model {rec['model']['name']} · vLLM {rec['packages'].get('vllm')} · block size "
          f"{res['engine']['block_size']} · {rec['scenario']['n_scenarios']} scenarios "
          f"({', '.join(rec['scenario']['families'])}) · {rec['config']['sessions']} sessions x "
          f"{rec['config']['turns']} turns · shared document {rec['config']['doc_tokens']} tokens\n")
    w("| rate (req/s) | field | arm | sent | hit rate (all) | hit rate (updates) | engine hit rate | "
          "TTFT p50 / p90 updates (s) | p90 ratio in_place/arm | throughput (req/s) | owned | "
          "correct (owned) | agreement with harness |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratio = res["aggregates"]["p90_ttft_ratio_vs_in_place"]
    for run in sorted(res["runs"], key=lambda r: (r["rate"], ["early", "middle", "late"].index(r["position"])
                                                   if r["position"] in ("early", "middle", "late") else 9)):
        arm, pos, rate = run["arm"], run["position"], run["rate"]
        r = ratio.get(arm, {}).get(pos, {}).get(str(rate))
        w(f"| {rate:g} | {pos} | {arm} | {run['n_sent']}/{run['n_sent'] + run['n_not_sent']} | "
              f"{fmt(run['hit_rate'], '.3f')} | {fmt(run['hit_rate_updates'], '.3f')} | "
              f"{fmt(run.get('engine_hit_rate'), '.3f')} | {fmt(run['ttft_updates_p50_s'], '.2f')} / "
              f"{fmt(run['ttft_updates_p90_s'], '.2f')} | {fmt(r, '.2f')} | {fmt(run['throughput_rps'], '.3f')} | "
              f"{run['n_owned']}/{run['n_sent']} | {fmt_p(run['correct_owned'])} | {fmt_p(run['agreement'])} |")
    cc = res["cross_check"]
    w(f"\ncross-check ({len(cc['rows'])} prompts, whole vocabulary): max |Δ log p| candidates "
          f"{cc['max_abs_diff_candidates']:.2e} nats, whole vocabulary {cc['max_abs_diff_vocab']:.2e} nats, "
          f"tolerance {cc['tolerance_nats']:g}, top-1 equal: {cc['all_top1_equal']}")
    diffs = [r["max_abs_diff_candidates"] for r in res["rows"] if r.get("sent") and r.get("kl_first_token") is None]
    if diffs:
        w(f"every request served exactly ({len(diffs)}; the connector's planned requests are approximate, "
          f"below): max |Δ log p| of the candidates vs the harness {max(diffs):.2e} nats")
    cold = [(r["arm"], r["position"], r["rate"]) for r in res["runs"]
            if not (r["reset_ok"] and r["first_request_cached_tokens"] == 0)]
    w(f"cold start: every run reset the prefix cache and its first request had 0 cached tokens: "
          f"{not cold}{'' if not cold else f' (not: {cold})'}")
    connector_rows(w, res)
    return w.text()


def _quantiles(values) -> tuple[float | None, float | None]:
    """p50 and p90 (linear interpolation, as the serving summaries) of the values that are not None."""
    v = [x for x in values if x is not None]
    return (float(np.percentile(v, 50)), float(np.percentile(v, 90))) if v else (None, None)


def connector_rows(w, res: dict) -> None:
    """The KV connector arms' table (``composed``, ``edited``; kvnotes.serving.connector): over the
    requests served with a plan, the paths that served them, the share of prompt tokens loaded, TTFT
    against the same prompts by a full prefill, and answers against the harness's full prefill.

    TTFT twice: as the client saw it (send to first output), and as the engine measured it
    (``first_token_latency``: arrival in the engine to the first token). The planned requests ask
    for the whole vocabulary's log-probs (the KL) and the baselines for the candidates' only, so the
    client's number charges the planned requests with turning ~50k log-probs into Python objects;
    the engine's does not."""
    speedup = res["aggregates"].get("p90_ttft_speedup_vs_full") or {}
    baseline = res["aggregates"].get("full_baseline") or {}
    runs = {(r["arm"], r["position"], r["rate"]): r for r in res["runs"]}
    arms = [k for k in runs if k[0] in baseline]
    if not arms:
        return
    w("\nKV connector arms (requests served with a plan; baseline: the same prompts by a full prefill):\n")
    w("| rate (req/s) | arm | planned requests | median prompt tokens | paths | loaded / prompt tokens | "
      "TTFT p50 / p90 (s) | baseline TTFT p50 / p90 (s) | p90 speedup | engine TTFT p50 / p90 (s) | "
      "baseline engine TTFT p50 / p90 (s) | engine p90 speedup | agreement with full prefill | "
      "correct (owned) | first-token KL p50 / max (nats) |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arm, pos, rate in sorted(arms, key=lambda k: (k[2], k[0])):
        run = runs[(arm, pos, rate)]
        base_arm, key = baseline[arm]
        base = runs.get((base_arm, pos, rate), {})
        rows = [r for r in res["rows"] if r.get("sent") and r["arm"] == arm and r["position"] == pos
                and r["rate"] == rate and r.get("kl_first_token") is not None]
        if not rows:
            continue
        p50 = key.replace("p90", "p50")
        updates = key.startswith("ttft_updates")          # the baseline's rows the arm is compared on
        base_rows = [r for r in res["rows"] if r.get("sent") and r["arm"] == base_arm and r["position"] == pos
                     and r["rate"] == rate and (r["turn"] > 0 or not updates)]
        eng = _quantiles([r.get("engine_first_token_latency_s") for r in rows])
        eng_base = _quantiles([r.get("engine_first_token_latency_s") for r in base_rows])
        owned = [r for r in rows if r["owned"]]
        kl = sorted(r["kl_first_token"] for r in rows)
        paths = ", ".join(f"{k} {v}" for k, v in sorted(run.get("paths", {}).items()))
        w(f"| {rate:g} | {arm} | {len(rows)} | {sorted(r['n_prompt'] for r in rows)[len(rows) // 2]} | {paths} | "
          f"{sum(r['loaded_tokens'] or 0 for r in rows) / sum(r['n_prompt'] for r in rows):.3f} | "
          f"{fmt(run.get(p50), '.2f')} / {fmt(run.get(key), '.2f')} | "
          f"{fmt(base.get(p50), '.2f')} / {fmt(base.get(key), '.2f')} ({base_arm}) | "
          f"{fmt(speedup.get(arm, {}).get(pos, {}).get(str(rate)), '.1f')}x | "
          f"{fmt(eng[0], '.2f')} / {fmt(eng[1], '.2f')} | {fmt(eng_base[0], '.2f')} / {fmt(eng_base[1], '.2f')} | "
          f"{fmt(eng_base[1] / eng[1] if eng[1] and eng_base[1] else None, '.1f')}x | "
          f"{sum(r['agree'] for r in rows)}/{len(rows)} | "
          f"{sum(r['served_correct'] for r in owned)}/{len(owned)} | "
          f"{kl[len(kl) // 2]:.3g} / {kl[-1]:.3g} |")


def results_table(recs: dict[str, dict]) -> str:
    """The per-family results table of one model and suite: a row per family (and ``all``), the
    columns every record's presentation declares (:class:`kvnotes.records.presentation.ResultsColumn`,
    in rank order), e.g. flipping pairs, field-only recovery, held-out top-k positions, the share of
    decisions that follow injected notes.

    Args:
        recs: name -> record of the same model and suite (any probe; one that declares no column
            adds none).

    Raises:
        ValueError: no record declares a column.
    """
    cols = sorted(((c, rec) for rec in recs.values() for c in presentation(rec).results), key=lambda x: x[0].rank)
    if not cols:
        raise ValueError(f"no record among {sorted(recs)} adds a column to the results table")
    fams = sorted({row["family"] for _, rec in cols for row in rec["result"].get("rows", []) if row.get("family")})
    w = Lines()
    w("| family | " + " | ".join(c.header for c, _ in cols) + " |")
    w("|---|" + "---|" * len(cols))
    for fam in [*fams, "all"]:
        w(f"| {fam} | " + " | ".join(c.cell(rec, fam) for c, rec in cols) + " |")
    w("\nIntervals: 95% two-stage cluster bootstrap with >= 5 scenarios; `t` = t-interval over scenario "
          "means (2-4 scenarios); `ti` = t-interval over instance means (1 scenario); none for a single cluster.")
    return w.text()


def suite_records(model_dir: str | Path, suite: str, read=None) -> dict[str, dict]:
    """The records :func:`results_table` reads: ``<model_dir>/<probe>/<suite>/record.json`` of every
    probe whose presentation declares results columns, by probe folder name.

    Args:
        suite: the suite's folder under each probe's, or a path below it (a run with overrides:
            ``default/<overrides>``).
        read: ``path -> record`` (default :func:`kvnotes.records.store.load_record`).
    """
    from kvnotes.records.store import load_record

    read = read or load_record
    paths = [d / suite / "record.json" for d in sorted(Path(model_dir).iterdir()) if d.is_dir()]
    recs = {path.relative_to(model_dir).parts[0]: read(path) for path in paths if path.is_file()}
    return {name: rec for name, rec in recs.items() if presentation(rec).results}
