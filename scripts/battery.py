#!/usr/bin/env python
"""Time every probe of the battery on one scenario suite, in one process, and print the total.

    OMP_NUM_THREADS=2 python -m scripts.battery [--scenario default] [--threads 2] [--probes a b ...]

The model (``--model``, default the embedded SmolLM2-135M) is loaded once and the pairs of the
suite prepared once per kind (field pairs; polarity pairs for ``dissociation``); then each probe's
``run(ctx)`` runs with its default config (``conf/probe/<name>.yaml``, progress bars off) exactly
as ``run.py`` would run it, and its wall time is printed as it finishes, with the total at the end.
Timings depend on the machine's load: report them with it (``os.getloadavg`` is printed).
``--json PATH`` also writes the numbers.
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
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()

    import torch
    from omegaconf import OmegaConf

    import probes
    from kvnotes.models import load_model
    from kvnotes.pairs import prepare_pairs, prepare_polarity_pairs
    from kvnotes.records import Timer

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model_cfg = OmegaConf.load(ROOT / "conf/model" / f"{args.model}.yaml")
    scen = OmegaConf.load(ROOT / "conf/scenario" / f"{args.scenario}.yaml")
    if "defaults" in scen:                        # e.g. small.yaml extends default.yaml
        scen = OmegaConf.merge(OmegaConf.load(ROOT / "conf/scenario/default.yaml"),
                               OmegaConf.masked_copy(scen, [k for k in scen if k != "defaults"]))
    bundle = load_model(model_cfg, args.device)
    kwargs = OmegaConf.to_container(model_cfg.chat_template_kwargs) if model_cfg.get("chat_template_kwargs") else {}
    pairs = {"field": prepare_pairs(bundle.tokenizer, scen, template_kwargs=kwargs)}
    setup = time.perf_counter() - t0
    names = args.probes or probes.names()
    print(f"battery: {args.model} on {args.device}, {torch.get_num_threads()} thread(s), scenario {args.scenario} "
          f"({len(pairs['field'].pairs)} aligned pairs); load average {os.getloadavg()[0]:.1f}; setup {setup:.1f} s",
          flush=True)
    times = {}
    for name in names:
        cfg = probes.load_config(name, {"progress": False})
        if cfg.pairs not in pairs:
            pairs[cfg.pairs] = prepare_polarity_pairs(bundle.tokenizer, scen, template_kwargs=kwargs)
        ctx = probes.ProbeContext(bundle=bundle, pairs=pairs[cfg.pairs], cfg=cfg, timer=Timer(), scenario_cfg=scen)
        t = time.perf_counter()
        probes.get(cfg)(ctx)
        times[name] = time.perf_counter() - t
        print(f"  {name:16s} {times[name]:8.1f} s   (load average {os.getloadavg()[0]:.1f})", flush=True)
    total = sum(times.values())
    print(f"  {'total':16s} {total:8.1f} s = {total / 60:.1f} min (+ setup {setup:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "scenario": args.scenario, "threads": args.threads,
                                               "setup_s": setup, "probe_s": times, "total_s": total,
                                               "loadavg_end": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
