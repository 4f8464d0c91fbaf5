#!/usr/bin/env python
"""Time every probe of the battery on one scenario suite, in one process, and print the total.

    OMP_NUM_THREADS=2 kvnotes battery [--scenario default] [--threads 2] [--probes a b ...] [--records runs]

The model (``--model``, default the embedded SmolLM2-135M) is loaded once and the pairs of the
suite prepared once per kind (field pairs; polarity pairs for a probe that asks for them), and each pair's
clean runs (prefix caches, clean scores, decisions) are computed once for the whole battery and
shared by every probe that screens it (:class:`kvnotes.harness.kit.CleanRuns`, up to ``--clean-runs-mb``
of caches; ``--clean-runs-mb 0`` makes every probe prefill its pairs itself, as ``run.py`` does,
for a before/after comparison). Then each probe runs through ``run.py``'s own job path
(:func:`kvnotes.cli.run.compose_jobs`, :func:`kvnotes.harness.jobs.run_job`): the config ``run.py``
composes for ``model=``, ``probe=``, ``scenario=`` (and ``device=`` when not ``auto``), checked
before the model loads, the probe's result checked against its schema, the record's envelope
checked; a line is printed before the model loads (``battery: loading <model> ...``) and as each
probe starts, its probe time as it finishes, with the total at the end (a probe whose pairs the suite cannot give, such as
polarity pairs from a suite without polarity scenarios, is skipped with one line). ``--floor`` also prints each probe's roofline floor: every
call of a linear layer (a forward hook on each ``nn.Linear``) costs at least its FLOPs at this
machine's best GEMM rate or its weight's bytes at its best weight-read rate, whichever is larger
(:class:`kvnotes.harness.roofline.Roofline`): a time no implementation making the same calls can beat (attention and
elementwise work are not counted). The rates (:func:`kvnotes.harness.roofline.machine_rates`) are measured before and after
the probes and the higher of each is used: a shared machine's speed drifts. It then holds each probe to the model's own
forward making the same calls (issue #37; target 1.2x): the model's plain decoder stack is timed feeding as many rows as
the probes' calls have (powers of two, on a cache of the suite's median prompt length;
:func:`kvnotes.harness.roofline.plain_ratios`), and each probe's linear calls are priced at that forward's measured /
floor ratio at their row count (:func:`kvnotes.harness.roofline.plain_equivalent`): measured / plain forward is the
harness's own overhead. It also times the model's plain forward
(:func:`kvnotes.harness.roofline.plain_forward`: a prefill and a decode at the suite's median prompt length) against
the same floor: how close a probe can come to its floor without a faster forward. ``--records DIR`` keeps
each probe's record where ``python run.py out_root=DIR`` would write it, the same record (without
``--records`` they go to a temporary folder); ``--compare EARLIER`` then prints, per probe, how its result differs from the record under
``EARLIER`` (:mod:`kvnotes.records.diff`: numbers beyond float tolerance, any other changed value; wall times skipped). Timings depend on the machine's load: report them with it
(``os.getloadavg`` is printed). ``--json PATH`` also writes the numbers. Each probe's line also gives
its peak memory above the level at its start (:class:`kvnotes.harness.peak_memory.PeakMemory`: resident
memory on the CPU, allocated memory on a GPU).

``--lengths 256,1024,4096`` runs the whole battery once per prompt length: the suite rendered as
multi-turn agent transcripts (``scenario.transcript``, :mod:`kvnotes.scenarios.transcript`) with as
many turns as bring its median prompt nearest each length (:func:`turns_for_lengths`), then a table
of each probe's time and peak memory per length and the exponent ``k`` of ``time ~ tokens^k``
fitted over the lengths (:func:`print_growth`); with ``--floor``, each probe's measured / plain forward and
measured / floor per length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

from kvnotes.cli import add_machine_flags
from kvnotes.cli.helptext import PlainHelpFormatter


def main() -> None:
    """Run the battery (see the module docstring).

    Raises:
        KvnotesError: an unknown model, scenario or probe, a negative ``--clean-runs-mb``, a
            ``--records`` or ``--json`` path that cannot be written, a ``--compare`` directory that
            does not exist or given with ``--lengths``, ``--lengths`` that are not token counts of at
            least 16, a config that does not compose; all before the model loads.
    """
    from kvnotes.cli.errors import check_writable, conf_name, existing_path, float_at_least
    from kvnotes.errors import KvnotesError

    from kvnotes.cli.run import user_config_dirs

    _, dirs = user_config_dirs(sys.argv[1:])          # first: the names below may come from them
    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__)
    ap.add_argument("--config-dir", action="append", default=[], metavar="DIR",
                    help="a folder of your own config groups (model/, probe/, scenario/), as kvnotes run --config-dir")
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model", dirs),
                    help="zoo config name under conf/model")
    ap.add_argument("--scenario", default="default", type=conf_name("scenario", "--scenario", dirs),
                    help="scenario config name under conf/scenario")
    add_machine_flags(ap, device="auto")
    ap.add_argument("--probes", nargs="*", default=None, type=probe_name(conf_name("probe", "--probes", dirs)),
                    help="probe names (default: every registered probe that runs on the scenario suite; the memory "
                         "probes, which bring their own suite, only when named)")
    ap.add_argument("--clean-runs-mb", type=float_at_least("--clean-runs-mb", 0.0), default=8192,
                    help="prefix caches kept across probes (MB); 0: no sharing, every probe prefills its pairs")
    ap.add_argument("--floor", action="store_true",
                    help="print each probe's roofline floor (linear-layer FLOPs and weight reads at this machine's rates)")
    ap.add_argument("--records", help="also write each probe's record under this out_root")
    ap.add_argument("--compare", metavar="DIR", type=existing_path("--compare", "dir"),
                    help="with --records: compare each record's result with the one under this earlier out_root "
                         "(kvnotes.records.diff; wall times skipped) and print what changed beyond tolerance")
    ap.add_argument("--lengths", type=lengths_arg, default=None, metavar="L1,L2,...",
                    help="run the battery once per prompt length (tokens): the suite rendered as agent transcripts "
                         "(scenario.transcript) with as many turns as reach each median length; prints each "
                         "probe's time and peak memory per length and the fitted exponent of time against length")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="Hydra overrides for every job, as kvnotes run takes them (e.g. flip_rule=relative); "
                         "PROBE:KEY=VALUE for one probe's jobs only (e.g. heads:probe.ks=[1,4])")
    args = ap.parse_args()
    args.overrides, args.probe_overrides = split_overrides(args.overrides)
    if args.compare and not args.records:
        raise KvnotesError("--compare needs --records (the new records it compares)")
    if args.compare and args.lengths:
        raise KvnotesError("--compare compares one suite's records; run it without --lengths")
    if args.records:
        check_writable(args.records, "--records", directory=True)
    if not args.lengths:
        out = run_suite(args, dirs, list(args.overrides))
    else:
        turns, loaded = turns_for_lengths(args, dirs), {}
        runs = {length: run_suite(args, dirs, [*args.overrides, f"scenario.transcript={{turns:{n}}}"],
                                  f"length {length} ({n} turns)", loaded) for length, n in turns.items()}
        out = {"lengths": {str(k): v for k, v in runs.items()}, "exponents": print_growth(runs)}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


def split_overrides(overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """Split the battery's overrides into those of every job and ``PROBE:KEY=VALUE`` ones of one
    probe's jobs (a probe's own keys, such as ``heads:probe.ks=[1,4]``, which the other probes'
    configs do not have).

    Returns:
        ``(every job's overrides, {probe name: its own overrides})``.

    Raises:
        KvnotesError: a ``NAME:`` prefix that names no registered probe.
    """
    import re

    import kvnotes.probes
    from kvnotes.errors import KvnotesError

    common: list[str] = []
    own: dict[str, list[str]] = {}
    for text in overrides:
        head, sep, rest = text.partition(":")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", head):   # e.g. scenario.transcript={turns:4}
            common.append(text)
            continue
        if head not in kvnotes.probes.names():
            raise KvnotesError(f"override '{text}': '{head}' is not a probe (PROBE:KEY=VALUE applies to one probe's "
                               f"jobs; probes: {', '.join(kvnotes.probes.names())})")
        own.setdefault(head, []).append(rest)
    return common, own


def probe_name(check):
    """An argparse ``type`` for ``--probes``: a probe name (``check``); an override (``KEY=VALUE``)
    there, which ``--probes``' list swallowed, is named as such.

    Raises:
        KvnotesError: an override, or what ``check`` raises.
    """
    from kvnotes.errors import KvnotesError

    def name(text: str) -> str:
        if "=" in text:
            raise KvnotesError(f"--probes: '{text}' is an override, not a probe; put overrides before --probes")
        return check(text)
    return name


def lengths_arg(text: str) -> list[int]:
    """An argparse ``type`` for ``--lengths``: comma-separated token counts of at least 16.

    Raises:
        KvnotesError: anything else.
    """
    from kvnotes.errors import KvnotesError

    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 16:
        raise KvnotesError(f"--lengths: comma-separated token counts of at least 16, got '{text}'")
    return sorted(set(values))


def turns_for_lengths(args, dirs) -> dict[int, int]:
    """The transcript turns (:mod:`kvnotes.scenarios.transcript`) whose median prompt is nearest each
    of ``--lengths``, from the suite's first pairs rendered by the model's tokenizer at 0 and 4 turns
    (each turn adds the same text on average). A length below the 0-turn transcript gets 0 turns."""
    from kvnotes.cli.run import compose_jobs, quiet_job
    from kvnotes.harness.pairs import prepare_pairs, template_kwargs
    from kvnotes.models.loading import load_tokenizer

    import tempfile

    out_root = args.records or tempfile.gettempdir()        # composing checks out_root: never create one here
    cfg = compose_jobs([["probe=screen", f"model={args.model}", f"scenario={args.scenario}",
                         *quiet_job(out_root, args.device), *args.overrides]], dirs)[0].cfg
    tok = load_tokenizer(cfg.model)
    median = {}
    for n in (0, 4):
        sc = cfg.scenario.copy()
        sc.n_instances, sc.transcript = 1, {"turns": n}
        lengths = sorted(len(p.old.ids) for p in prepare_pairs(tok, sc, template_kwargs=template_kwargs(cfg.model) or None).pairs[:12])
        median[n] = lengths[len(lengths) // 2]
    per_turn = max(1.0, (median[4] - median[0]) / 4)
    return {length: max(0, round((length - median[0]) / per_turn)) for length in args.lengths}


def print_growth(runs: dict[int, dict]) -> dict[str, float | None]:
    """Print each probe's time, peak memory and pairs measured (its result's rows) per length, and the
    exponent ``k`` of a least-squares fit ``time ~ tokens^k`` over the lengths at which the probe
    measured any pair (None with fewer than two). Runs at different lengths may measure different
    pairs (what flips changes with the length); the counts are printed beside the times."""
    import numpy as np

    lengths = list(runs)
    probes = list(dict.fromkeys(p for r in runs.values() for p in r["probe_s"]))
    tokens = [runs[n]["median_tokens"] for n in lengths]
    print(f"battery --lengths: median prompt tokens {tokens}; time (s), peak memory above the probe's start (MB) "
          f"and pairs measured (p)")
    print(f"  {'probe':16s} " + " ".join(f"{f'{t} tok':>24s}" for t in tokens) + f" {'exponent':>9s}")
    exps: dict[str, float | None] = {}
    for p in probes:
        cells = [(runs[n]["median_tokens"], runs[n]["probe_s"].get(p), runs[n]["peak_mb"].get(p),
                  runs[n]["pairs_measured"].get(p)) for n in lengths]
        timed = [(t, s) for t, s, _, f in cells if s is not None and s > 0 and f != 0]
        exps[p] = float(np.polyfit(np.log([t for t, _ in timed]), np.log([s for _, s in timed]), 1)[0]) \
            if len({t for t, _ in timed}) >= 2 else None          # lengths that render to one token count fit nothing
        print(f"  {p:16s} " + " ".join(f"{s:7.1f} s {m:6.0f} MB {f if f is not None else '-':>4} p" if s is not None
                                       else f"{'-':>24s}" for _, s, m, f in cells)
              + (f" {exps[p]:9.2f}" if exps[p] is not None else f" {'-':>9s}"))
    if all(r.get("roofline") for r in runs.values()):          # --floor: the harness held to the model's own forward
        print("  measured / the plain forward of the same calls (target 1.2x), and / the floor")
        for p in probes:
            cells = []
            for n in lengths:
                roof = runs[n]["roofline"]
                over, floor = roof["overhead"].get(p), roof["probes"].get(p)
                cells.append(f"{over['ratio']:6.2f}x plain {runs[n]['probe_s'][p] / floor['floor_s']:6.2f}x floor"
                             if over and over["ratio"] and floor and floor["floor_s"] else f"{'-':>24s}")
            print(f"  {p:16s} " + " ".join(f"{c:>24s}" for c in cells))
    return exps


def run_suite(args, dirs, extra: list[str], label: str = "", loaded: dict | None = None) -> dict:
    """Run the battery's probes on one suite (``extra``: overrides of every job, e.g. a transcript
    length), printing each probe's time as it finishes; returns the numbers ``--json`` writes.
    ``loaded`` keeps the model (and its :class:`Roofline` hooks) between calls: ``--lengths`` loads
    it once."""
    from kvnotes.errors import KvnotesError

    import tempfile

    import torch

    import kvnotes.probes
    from kvnotes.cli.run import compose_jobs, quiet_job
    from kvnotes.harness.jobs import load_bundle, run_job
    from kvnotes.harness.kit import CleanRuns
    from kvnotes.harness.pairs import prepare_for_probe
    from kvnotes.records.diff import result_diff
    from kvnotes.records.store import load_record, record_problem
    from kvnotes.harness.peak_memory import PeakMemory
    from kvnotes.harness.roofline import Roofline, machine_rates, plain_equivalent, plain_forward, plain_ratios, row_grid

    torch.set_num_threads(args.threads)
    names = args.probes or kvnotes.probes.names()
    scratch = None if args.records else tempfile.TemporaryDirectory(prefix="kvnotes-battery-")
    out_root = args.records or scratch.name                          # type: ignore[union-attr]
    # run.py's own overrides for each probe, so each record is the one `kvnotes run` writes; the keys that
    # cannot change a result (plot, progress, out_root) name no record directory
    common = [f"model={args.model}", f"scenario={args.scenario}", *quiet_job(out_root, args.device), *extra]
    if args.probes is None:     # the scenario suite's probes; the memory probes (pairs: none) bring their own data
        names = [n for n in names if kvnotes.probes.load_config(n, {}).pairs != "none"]
    per_probe = getattr(args, "probe_overrides", {})
    jobs = dict(zip(names, compose_jobs([[f"probe={n}", *common, *per_probe.get(n, [])] for n in names], dirs)))  # checked before the model loads
    t0 = time.perf_counter()
    first = jobs[names[0]].cfg
    loaded = {} if loaded is None else loaded
    if not loaded.get("bundle"):                # minutes for a large model: say so before the first probe's line
        print(f"battery: loading {args.model} ...", flush=True)
    bundle = loaded["bundle"] = loaded.get("bundle") or load_bundle(first)
    pair_sets = {"field": prepare_for_probe(bundle.tokenizer, "field", first.scenario, first.model)}
    setup = time.perf_counter() - t0
    field_pairs = pair_sets["field"].pairs
    tokens = sorted(len(p.old.ids) for p in field_pairs)[len(field_pairs) // 2] if field_pairs else 0
    print(f"battery: {args.model} on {next(bundle.model.parameters()).device}, {torch.get_num_threads()} thread(s), scenario {args.scenario}"
          f"{', ' + label if label else ''} ({len(field_pairs)} aligned pairs, median {tokens} tokens); "
          f"load average {os.getloadavg()[0]:.1f}; setup {setup:.1f} s", flush=True)
    store = CleanRuns(int(args.clean_runs_mb * (1 << 20))) if args.clean_runs_mb > 0 else None
    times, seen, diffs, peaks, measured = {}, {}, {}, {}, {}
    roof = loaded.setdefault("roof", Roofline(bundle.model)) if args.floor else None
    rates = [machine_rates(bundle.model)] if roof else []
    for i, name in enumerate(names, 1):
        job = jobs[name]
        kind = kvnotes.probes.typed_config(job.cfg.probe).pairs
        if kind not in pair_sets:
            try:
                pair_sets[kind] = prepare_for_probe(bundle.tokenizer, kind, job.cfg.scenario, job.cfg.model)
            except KvnotesError as exc:          # e.g. polarity pairs from a suite without polarity scenarios
                print(f"  {name:16s}  skipped: {exc}", flush=True)
                continue
        done = roof.calls.copy() if roof else None
        print(f"  {name:16s} running (probe {i} of {len(names)}) ...", flush=True)
        # the job path of run.py: the probe, its result checked against its schema, the record's envelope
        with PeakMemory(bundle.model.device, interval_s=0.01) as rss:
            path = run_job(job.cfg, job.out_dir, job.hydra_info, log=lambda _: None, bundle=bundle, clean_runs=store,
                           pair_sets=pair_sets)
        peaks[name] = rss.mb
        record = load_record(path)
        times[name] = record["timing"]["probe"]
        rows = record["result"].get("rows")
        measured[name] = len(rows) if isinstance(rows, list) else None      # the pairs the probe measured
        if roof and done is not None:
            seen[name] = roof.calls - done
        print(f"  {name:16s} {times[name]:8.1f} s  peak +{peaks[name]:.0f} MB  {measured[name]} pairs measured  "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        if args.compare:
            ref = Path(args.compare) / path.relative_to(out_root)
            earlier, why = record_problem(ref) if ref.is_file() else (None, None)
            diffs[name] = (result_diff(record["result"], earlier["result"]).summary() if earlier is not None
                           else f"earlier record {ref} not read: {why}" if why else f"no earlier record at {ref}")
            print(f"  {'':16s} vs {args.compare}: {diffs[name]}", flush=True)
    if scratch is not None:
        scratch.cleanup()
    total = sum(times.values())
    print(f"  {'total':16s} {total:8.1f} s = {total / 60:.1f} min (+ setup {setup:.1f} s)")
    floors, plain, overhead, ratios = {}, None, {}, {}
    if roof:
        rates.append(machine_rates(bundle.model))
        flop_rate, byte_rate = max(r[0] for r in rates), max(r[1] for r in rates)
        grid = row_grid(sum(seen.values(), Counter()))
        ratios = plain_ratios(bundle.model, roof, (flop_rate, byte_rate), tokens, grid) if grid else {}
        print(f"  roofline floor at {flop_rate / 1e9:.0f} GFLOP/s (best GEMM at the MLP shape; before/after: "
              f"{', '.join(f'{r[0] / 1e9:.0f}' for r in rates)}) and {byte_rate / 1e9:.1f} GB/s (one-row product "
              f"with the unembedding; {', '.join(f'{r[1] / 1e9:.1f}' for r in rates)}); the plain forward of the same "
              f"calls (the model's own decoder stack feeding as many rows on a {tokens}-token cache; measured / floor at "
              + ", ".join(f"{r} rows {x:.2f}x" for r, x in ratios.items()) + "):")
        for name, calls in seen.items():
            floors[name] = Roofline.floor(calls, flop_rate, byte_rate)
            p = plain_equivalent(calls, (flop_rate, byte_rate), ratios)
            overhead[name] = {"plain_s": p, "ratio": times[name] / p if p > 0 else None}
            over = f"{overhead[name]['ratio']:.2f}x" if p > 0 else "-"
            print(f"  {name:16s} {floors[name]['floor_s']:8.1f} s floor ({floors[name]['flops'] / 1e12:5.1f} TFLOP, "
                  f"{floors[name]['weight_bytes'] / 1e12:5.2f} TB of weights read), {p:8.1f} s plain forward; "
                  f"measured {times[name]:.1f} s: {over} the plain forward (target 1.2x), "
                  + (f"{times[name] / floors[name]['floor_s']:.2f}x" if floors[name]["floor_s"] else "-") + " the floor")
        f = sum(v["floor_s"] for v in floors.values())
        p = sum(v["plain_s"] for v in overhead.values())
        print(f"  {'total':16s} {f:8.1f} s floor, {p:8.1f} s plain forward; measured {total:.1f} s: "
              f"{total / p if p else float('nan'):.2f}x the plain forward, {total / f if f else float('nan'):.2f}x the floor")
        plain = plain_forward(bundle.model, roof, (flop_rate, byte_rate), tokens)
        print(f"  the model's plain forward (transformers, no hooks; median prompt {tokens} tokens) against the same floor: "
              + ", ".join(f"{r['what']} {r['ratio']:.2f}x" for r in plain))
    if store is not None:
        print(f"  clean runs: {store.prefilled} prompts prefilled ({store.shared} more shared by other pairs), "
              f"{store.reused} runs reused from the store "
              f"({store.used_bytes / 2**20:.0f} MB of prefix caches kept)")
    return {"model": args.model, "scenario": args.scenario, "overrides": extra,
            "probe_overrides": {n: v for n, v in per_probe.items() if n in times}, "threads": args.threads,
            "median_tokens": tokens, "setup_s": setup, "probe_s": times, "peak_mb": peaks, "pairs_measured": measured,
            "total_s": total,
            "roofline": {"rates_before_after": rates, "probes": floors, "plain_forward": plain,
                         "plain_ratios": ratios, "overhead": overhead} if roof else None,
            "clean_runs_mb": args.clean_runs_mb,
            "compare": {"against": args.compare, "probes": diffs} if args.compare else None,
            "clean_runs": ({"prompts_prefilled": store.prefilled, "prompts_shared": store.shared, "runs_reused": store.reused}
                           if store is not None else None),
            "loadavg_end": os.getloadavg()}


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
