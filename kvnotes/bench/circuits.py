#!/usr/bin/env python
"""Timing of one head patch against one plain forward on the embedded model.

    OMP_NUM_THREADS=1 kvnotes bench circuits [--repeats N] [--chunk C] [--scenario-id ID]

Prints one line per mode: seconds per head patch (read: decision position on the old prefix
cache; write: note positions [b, d) resumed from b) in batches of ``chunk`` heads, and the time of
one plain full forward of the same prompt.
"""

from __future__ import annotations

import argparse
import time
from kvnotes import CONF_DIR
from kvnotes.scenarios.schema import SUITES_DIR
from kvnotes.cli.helptext import PlainHelpFormatter



def main() -> None:
    """Run the benchmark (see the module docstring).

    Raises:
        KvnotesError: ``--repeats`` or ``--chunk`` below 1; ScenarioError: no scenario of that id;
            both before the model loads.
    """
    from kvnotes.cli import add_machine_flags
    from kvnotes.cli.errors import conf_name, int_at_least

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int_at_least("--repeats", 1), default=3, help='timed repeats per path (the median is reported)')
    ap.add_argument("--chunk", type=int_at_least("--chunk", 1), default=16, help="head variants per batched forward")
    ap.add_argument("--scenario-id", default="favourite_colour", help='the scenario whose flipping pairs are timed')
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"), help="conf/model/<name>.yaml")
    add_machine_flags(ap)
    args = ap.parse_args()
    from kvnotes.scenarios import build_pairs, load_suite

    scenarios = load_suite([str(SUITES_DIR)], ids=[args.scenario_id])   # before the model loads
    import torch
    from omegaconf import OmegaConf

    from kvnotes.kv import cache as kvcache
    from kvnotes.harness.head_patch import head_outputs, patched_scores, set_masks
    from kvnotes.kv.engine import make_engine
    from kvnotes.models.loading import load_model
    from kvnotes.harness.readout import run_pair
    from kvnotes.harness.tokens import tokenize_pair

    torch.set_num_threads(args.threads)
    bundle = load_model(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml"), args.device)
    model = bundle.model
    spec = build_pairs(scenarios, 1, 0)[0]
    pair = tokenize_pair(bundle.tokenizer, spec)
    run = run_pair(model, pair)
    engine = make_engine(model)
    L, H = engine.adapter.n_layers, engine.adapter.n_heads
    src = head_outputs(engine, pair.new.ids)
    ids = pair.old.ids[None]

    def best(fn):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    with torch.no_grad():
        plain = best(lambda: model(ids))
    sets = [[(l % L, h % H)] for l, h in zip(range(args.chunk), range(args.chunk))]
    masks = set_masks(sets, L, H)
    prefix = kvcache.prefix_cache(model, run.old_cache, pair.old.ids, pair.field[1])
    out: dict = {"model": args.model, "device": args.device, "threads": args.threads, "chunk": args.chunk,
                 "plain_forward_ms": plain * 1e3}
    for mode, pre in (("read", run.old_cache), ("write", prefix)):
        t = best(lambda: patched_scores(engine, run, src, masks, mode, pre, args.chunk)) / args.chunk
        out[f"{mode}_ms_per_head"] = t * 1e3
        print(f"bench_circuits: {mode} head patch {t * 1e3:.1f} ms/head (batch {args.chunk}, T={len(pair.old.ids)}, "
              f"downstream {pair.decision - pair.field[1]}) vs plain forward {plain * 1e3:.1f} ms "
              f"-> {t / plain:.2f} forwards per head patch [{model.dtype}, {engine.backend}]")
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)      # checked writable before the model loaded
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
