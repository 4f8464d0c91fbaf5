#!/usr/bin/env python
"""Benchmark the batched single-position map against a naive per-variant loop, in one process.

    kvnotes bench probes [--n-pairs 3] [--repeats 3] [--min-time 10] [--threads N] [--turns 6]

On the same flipping recall pairs of the embedded SmolLM2-135M (``--model`` picks another zoo
config; ``--turns 6`` renders them as the paper's ~900-token agent transcripts), the single-position map (every downstream position ``p`` in ``[b, d)`` patched alone from
the new run into the old run, all layers, decision score read) is computed two ways:

- **batched**: the probe's machinery, :func:`kvnotes.harness.kit.single_position_scores` (patch masks;
  one cache-free forward per chunk of variants, each attending to the one shared old prefix cache
  plus its own substituted K/V, :func:`kvnotes.kv.patch.patched_logits`; only the two candidates'
  logits are computed);
- **naive**: per variant, ``copy.deepcopy`` of the whole old cache, the position's K/V copied from
  the new cache in every layer, one batch-1 decode of the decision token.

Printed: wall time of each (the best call, after a warm-up pair; each method is called at least
``--repeats`` times and for at least ``--min-time`` seconds, like ``timeit``, so the fast method is
not judged on a 2-second stretch of a noisy machine while the slow one gets 45 s; the median is
printed too), the speed ratio of the best times and of the medians, the
max abs difference of the two maps (scores in nats and recoveries), and the peak memory each
method added above its starting point (resident set size sampled every 2 ms on CPU, after
``malloc_trim`` returned freed heap pages; peak allocated CUDA memory on GPU), plus the process's
``ru_maxrss``. ``--json PATH`` also writes the numbers.

Without the checkpoint (a GPU machine has no weights): ``--random-init MODEL`` builds the zoo
entry's full-size architecture (``conf/model/MODEL.yaml``) with random weights and times the map on synthetic pairs of
``--prompt-len`` random tokens (one field token changed; candidates: the two runs' top-1 tokens).
The ratio and the exactness check hold; the scores mean nothing.

Threads: ``--threads`` defaults to ``OMP_NUM_THREADS`` when set, else every CPU the process may use
(``os.sched_getaffinity``; torch's
own default counts physical cores, 1 on the 2-vCPU CI machine). The naive loop's batch-1 decode is
bound by reading the weights from memory, the batched one by arithmetic, so the ratio grows with
the cores (docs/results/performance.md has the numbers of the 2-vCPU CI machine).
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
from pathlib import Path

from kvnotes import CONF_DIR
from kvnotes.scenarios.schema import SUITES_DIR
from kvnotes.cli import add_machine_flags
from kvnotes.harness.peak_memory import PeakMemory
from kvnotes.harness.timing import time_calls
from kvnotes.cli.helptext import PlainHelpFormatter


import torch


@torch.no_grad()
def naive_single_position_scores(model, run) -> torch.Tensor:
    """The single-position map by a per-variant loop: deep-copy the old cache, patch position ``p``
    in every layer from the new cache, decode the decision token. Returns ``[d - b]`` scores (nats)."""
    from kvnotes.kv import cache as kvcache

    pair = run.pair
    b, d = pair.downstream
    tok = pair.old.ids[d: d + 1].view(1, 1).to(model.device)
    pos = torch.tensor([[d]], device=model.device)
    mask = torch.ones(1, d + 1, dtype=torch.long, device=model.device)
    out = []
    for p in range(b, d):
        cache = copy.deepcopy(run.old_cache)
        for lo, ln in zip(cache.layers, run.new_cache.layers, strict=True):
            slot = (kvcache.slot_positions(lo) == p).nonzero().flatten()
            lo.keys[:, :, slot] = ln.keys[:, :, slot]
            lo.values[:, :, slot] = ln.values[:, :, slot]
        logits = model(input_ids=tok, position_ids=pos, attention_mask=mask, past_key_values=cache).logits
        lp = torch.log_softmax(logits[0, -1].float(), -1)
        out.append(lp[pair.cand_new[0]] - lp[pair.cand_old[0]])
    return torch.stack(out)


def flipping_recall_pairs(bundle, n_pairs: int, scenario_ids: list[str] | None, turns: int | None = None):
    """The first ``n_pairs`` flipping recall pairs (one instance per scenario), with their runs;
    ``turns``: rendered as agent transcripts with that many unrelated exchanges
    (:mod:`kvnotes.scenarios.transcript`; 6 gives the paper's ~900 tokens)."""
    from kvnotes.harness.readout import screen_pair
    from kvnotes.harness.tokens import tokenize_pair
    from kvnotes.scenarios import build_pairs, load_suite

    specs = build_pairs(load_suite([str(SUITES_DIR)], ["recall"], scenario_ids), 1, 0)
    runs = []
    for spec in specs:
        tp = tokenize_pair(bundle.tokenizer, spec, turns=turns)
        if isinstance(tp, str):
            continue
        run, status = screen_pair(bundle.model, tp)
        if status["flips"]:
            runs.append(run)
        if len(runs) == n_pairs:
            break
    return runs


def random_model(name: str, device: str, dtype: str | None):
    """A model with random weights (seed 0) of the zoo entry ``name``'s full-size architecture
    (``conf/model/<name>.yaml``, :func:`kvnotes.models.zoo.random_model`), sdpa attention."""
    from kvnotes.models.zoo import random_model as zoo_random_model, zoo_config

    dt = getattr(torch, dtype) if dtype else torch.float32
    return zoo_random_model(zoo_config(name), shrink=False, dtype=dt, device=device, attn_implementation="sdpa")


def synthetic_runs(model, n_pairs: int, length: int):
    """``n_pairs`` clean runs of random-token pairs of ``length`` tokens differing in one field token
    at a third of the prompt, decision at the last position; each pair's candidates are its two
    runs' top-1 tokens (pairs whose runs agree are skipped): a random model decides nothing, so
    these serve timing and exactness only."""
    from types import SimpleNamespace

    from kvnotes.harness.readout import run_pair

    a, d = length // 3, length - 1
    g = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    runs = []
    for _ in range(50 * n_pairs):
        old = torch.randint(0, vocab, (length,), generator=g)
        new = old.clone()
        new[a] = (old[a] + 1 + torch.randint(0, vocab - 1, (1,), generator=g)) % vocab
        with torch.no_grad():
            top = [int(model(x[None].to(model.device), logits_to_keep=1).logits[0, -1].argmax()) for x in (old, new)]
        if top[0] == top[1]:
            continue
        pair = SimpleNamespace(old=SimpleNamespace(ids=old), new=SimpleNamespace(ids=new), field=(a, a + 1),
                               decision=d, downstream=(a + 1, d), cand_old=(top[0],), cand_new=(top[1],))
        runs.append(run_pair(model, pair))
        if len(runs) == n_pairs:
            break
    return runs


def timed(fn, device, repeats: int, min_time: float):
    """(result of the last call, wall times in s, peak memory of one more call).

    ``fn`` is called at least ``repeats`` times and until the calls add up to ``min_time`` seconds
    (as ``timeit`` does), so that a fast method is sampled over as long a stretch of the machine's
    state as a slow one. Memory is sampled in a separate call: the sampling thread would compete
    with torch's threads for the cores and perturb the timed calls."""
    timing, res = time_calls(fn, 0, repeats, min_time)
    times = [ms / 1e3 for ms in timing.trials_ms]
    with PeakMemory(device) as pm:
        fn()
    return res, times, pm.peak


def main() -> None:
    """Run the benchmark (see the module docstring).

    Raises:
        KvnotesError: a bad flag (an unknown model or dtype, a count below 1, a negative time, a
            non-positive budget, ``--turns`` with ``--random-init``) before the model loads; no flipping recall pair to time.
    """
    from kvnotes.cli.errors import DTYPES, conf_name, float_at_least, int_at_least, one_of
    from kvnotes.errors import KvnotesError

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__)
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"),
                    help="zoo config name under conf/model")
    add_machine_flags(ap)
    ap.add_argument("--n-pairs", type=int_at_least("--n-pairs", 1), default=3, help='flipping pairs timed')
    ap.add_argument("--scenarios", nargs="*", default=None, help="recall scenario ids (default: all)")
    ap.add_argument("--repeats", type=int_at_least("--repeats", 1), default=3,
                    help="least timed calls per method (best is kept)")
    ap.add_argument("--min-time", type=float_at_least("--min-time", 0.0), default=10.0,
                    help="least seconds of timed calls per method (more calls of a fast method)")
    ap.add_argument("--budget-mb", type=float_at_least("--budget-mb", 0.0, strict=True), default=1024,
                    help="memory budget per chunk of variant caches")
    ap.add_argument("--turns", type=int_at_least("--turns", 0), default=None,
                    help="render the recall pairs as agent transcripts with this many unrelated exchanges "
                         "(scenario.transcript; 6: about 900 tokens, the paper's prompt length)")
    ap.add_argument("--random-init", metavar="MODEL", type=conf_name("model", "--random-init"),
                    help="timing only, without the checkpoint: the full-size architecture of this zoo entry "
                         "(conf/model/MODEL.yaml) with random weights (e.g. a GPU machine without weights), on "
                         "synthetic pairs")
    ap.add_argument("--prompt-len", type=int_at_least("--prompt-len", 4), default=110,
                    help="--random-init: prompt length in tokens")
    ap.add_argument("--dtype", default=None, type=one_of("--dtype", DTYPES),
                    help=f"--random-init: torch dtype ({', '.join(DTYPES)}; default: float32)")
    args = ap.parse_args()
    if args.turns is not None and args.random_init:
        raise KvnotesError("--turns renders the scenario pairs as transcripts; --random-init times synthetic pairs "
                           "of --prompt-len tokens instead")
    if args.scenarios:                  # the recall scenario ids, checked before the model loads
        from kvnotes.scenarios import load_suite

        load_suite([str(SUITES_DIR)], ["recall"], args.scenarios)
    torch.set_num_threads(args.threads)

    from kvnotes.harness.kit import single_position_scores

    if args.random_init:
        model = random_model(args.random_init, args.device, args.dtype)
        runs = synthetic_runs(model, args.n_pairs, args.prompt_len)
        name = f"{args.random_init} (random weights)"
    else:
        from omegaconf import OmegaConf

        from kvnotes.models.loading import load_model

        bundle = load_model(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml"), args.device)
        model, name = bundle.model, args.model
        runs = flipping_recall_pairs(bundle, args.n_pairs, args.scenarios, args.turns)
    device = model.device
    if not runs:
        raise KvnotesError("no flipping recall pair to benchmark")
    budget = int(args.budget_mb * (1 << 20))
    n_variants = sum(r.pair.decision - r.pair.field[1] for r in runs)

    def batched():
        return [single_position_scores(model, r, budget_bytes=budget) for r in runs]

    def naive():
        return [naive_single_position_scores(model, r) for r in runs]

    # warm-up (allocator, kernels) on the first pair, both ways
    single_position_scores(model, runs[0], budget_bytes=budget)
    naive_single_position_scores(model, runs[0])
    s_batched, ts_batched, m_batched = timed(batched, device, args.repeats, args.min_time)
    s_naive, ts_naive, m_naive = timed(naive, device, args.repeats, args.min_time)
    t_batched, t_naive = min(ts_batched), min(ts_naive)
    med_batched, med_naive = statistics.median(ts_batched), statistics.median(ts_naive)
    diff_s = max(float((a - b).abs().max()) for a, b in zip(s_batched, s_naive, strict=True))
    diff_r = max(float((r.recovery(a) - r.recovery(b)).abs().max()) for r, a, b in zip(runs, s_batched, s_naive,
                                                                                          strict=True))
    out = {
        "model": name, "device": str(device), "dtype": str(next(model.parameters()).dtype),
        "threads": torch.get_num_threads(), "pairs": [r.pair.spec.id if hasattr(r.pair, "spec") else "synthetic" for r in runs],
        "tokens": [int(r.pair.decision) for r in runs], "n_variants": n_variants, "budget_mb": args.budget_mb,
        "batched_s": t_batched, "naive_s": t_naive, "speedup": t_naive / t_batched,
        "batched_times_s": ts_batched, "naive_times_s": ts_naive, "speedup_of_medians": med_naive / med_batched,
        "max_abs_diff_score_nats": diff_s, "max_abs_diff_recovery": diff_r,
        "peak_mem_batched_mb": m_batched / 2**20, "peak_mem_naive_mb": m_naive / 2**20,
        "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(f"model {name} on {out['device']} ({out['dtype']}, {out['threads']} thread(s)); "
          f"{len(runs)} {'synthetic' if args.random_init else 'recall'} pairs of {out['tokens']} tokens, "
          f"{n_variants} single-position variants")
    print(f"  batched (shared prefix, candidate logits): {t_batched:8.2f} s  "
          f"({1e3 * t_batched / n_variants:.1f} ms/variant; median {med_batched:.2f} s of {len(ts_batched)} calls), "
          f"peak +{out['peak_mem_batched_mb']:.0f} MB")
    print(f"  naive (deepcopy per variant):              {t_naive:8.2f} s  "
          f"({1e3 * t_naive / n_variants:.1f} ms/variant; median {med_naive:.2f} s of {len(ts_naive)} calls), "
          f"peak +{out['peak_mem_naive_mb']:.0f} MB")
    print(f"  speed ratio naive/batched: {out['speedup']:.1f}x (best times; {out['speedup_of_medians']:.1f}x of the medians)")
    print(f"  max abs difference: score {diff_s:.2e} nats, recovery {diff_r:.2e}")
    print(f"  process ru_maxrss: {out['ru_maxrss_mb']:.0f} MB")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
