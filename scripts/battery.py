#!/usr/bin/env python
"""Time every probe of the battery on one scenario suite, in one process, and print the total.

    OMP_NUM_THREADS=2 python -m scripts.battery [--scenario default] [--threads 2] [--probes a b ...] [--records runs]

The model (``--model``, default the embedded SmolLM2-135M) is loaded once and the pairs of the
suite prepared once per kind (field pairs; polarity pairs for ``dissociation``), and each pair's
clean runs (prefix caches, clean scores, decisions) are computed once for the whole battery and
shared by every probe that screens it (:class:`kvnotes.kit.CleanRuns`, up to ``--clean-runs-mb``
of caches; ``--clean-runs-mb 0`` makes every probe prefill its pairs itself, as ``run.py`` does,
for a before/after comparison). Then each probe's
``run(ctx)`` runs with the config ``run.py`` would compose for it (``conf/config.yaml`` with
``model=``, ``probe=``, ``scenario=``; progress bars off), and its wall time is printed as it
finishes, with the total at the end. ``--records DIR`` also writes each probe's record where
``python run.py out_root=DIR`` would (``DIR/<model>/<probe>/<scenario>/record.json``), checked
against the probe's schema. Timings depend on the machine's load: report them with it
(``os.getloadavg`` is printed). ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent   # the checkout (conf/)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="zoo config name under conf/model")
    ap.add_argument("--scenario", default="default", help="scenario config name under conf/scenario")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--probes", nargs="*", default=None, help="probe names (default: every registered probe)")
    ap.add_argument("--clean-runs-mb", type=float, default=8192,
                    help="prefix caches kept across probes (MB); 0: no sharing, every probe prefills its pairs")
    ap.add_argument("--records", help="also write each probe's record under this out_root")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()

    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import probes
    from kvnotes.kit import CleanRuns
    from kvnotes.models import load_model
    from kvnotes.pairs import prepare_for_probe
    from kvnotes.records import RECORD_NAME, Timer, complete_record, to_jsonable, write_atomic
    from kvnotes.schema import check_result, result_schema

    torch.set_num_threads(args.threads)
    names = args.probes or probes.names()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfgs = {n: compose("config", overrides=[f"model={args.model}", f"probe={n}", f"scenario={args.scenario}",
                                                f"device={args.device}", "probe.progress=false"]) for n in names}
    t0 = time.perf_counter()
    first = cfgs[names[0]]
    bundle = load_model(first.model, args.device)
    pairs = {"field": prepare_for_probe(bundle.tokenizer, "field", first.scenario, first.model)}
    setup = time.perf_counter() - t0
    print(f"battery: {args.model} on {args.device}, {torch.get_num_threads()} thread(s), scenario {args.scenario} "
          f"({len(pairs['field'].pairs)} aligned pairs); load average {os.getloadavg()[0]:.1f}; setup {setup:.1f} s",
          flush=True)
    store = CleanRuns(int(args.clean_runs_mb * (1 << 20))) if args.clean_runs_mb > 0 else None
    times = {}
    for name in names:
        cfg = cfgs[name]
        probe_cfg = probes.typed_config(cfg.probe)
        if probe_cfg.pairs not in pairs:
            pairs[probe_cfg.pairs] = prepare_for_probe(bundle.tokenizer, probe_cfg.pairs, cfg.scenario, cfg.model)
        timer = Timer()
        ctx = probes.ProbeContext.from_run_config(cfg, probe_cfg, bundle, pairs[probe_cfg.pairs], timer, store)
        t = time.perf_counter()
        with timer("probe"):
            result = probes.get(probe_cfg)(ctx)
        times[name] = time.perf_counter() - t
        print(f"  {name:16s} {times[name]:8.1f} s   (load average {os.getloadavg()[0]:.1f})", flush=True)
        if args.records:
            result = to_jsonable(result)
            check_result(result, result_schema(probes.module(probe_cfg)))
            cfg_dict = OmegaConf.to_container(cfg, resolve=False)
            cfg_dict["out_root"] = args.records
            path = Path(args.records) / cfg.model.name / cfg.probe.name / cfg.scenario.name / RECORD_NAME
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, complete_record(OmegaConf.to_container(OmegaConf.create(cfg_dict), resolve=True),
                                               {"launcher": "scripts.battery"}, bundle, pairs[probe_cfg.pairs],
                                               cfg.scenario, result, timer.stages))
    total = sum(times.values())
    print(f"  {'total':16s} {total:8.1f} s = {total / 60:.1f} min (+ setup {setup:.1f} s)")
    if store is not None:
        print(f"  clean runs: {store.prefilled} prompts prefilled ({store.shared} more shared by other pairs), "
              f"{store.reused} runs reused from the store "
              f"({store.used_bytes / 2**20:.0f} MB of prefix caches kept)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "scenario": args.scenario, "threads": args.threads,
                                               "setup_s": setup, "probe_s": times, "total_s": total,
                                               "clean_runs_mb": args.clean_runs_mb,
                                               "clean_runs": ({"prompts_prefilled": store.prefilled, "prompts_shared": store.shared,
                                                               "runs_reused": store.reused}
                                                              if store is not None else None),
                                               "loadavg_end": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
