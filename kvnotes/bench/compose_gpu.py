#!/usr/bin/env python
"""Where the composed time-to-first-token goes, stage by stage, on the GPU bench model.

    kvnotes bench compose-gpu --lengths 2048 32768 [--seam 4] [--profiler]

Same model and prompt as ``kvnotes bench compose --device cuda`` (random Qwen3-8B-shaped, bf16; prefix
``--prefix`` + one chunk + suffix ``--suffix`` tokens). Per length, medians over ``--trials`` after
``--warmup`` untimed runs, each stage timed alone (``kvnotes.harness.timing.elapsed_ms``: a
``torch.utils.benchmark`` measurement, the device synchronised before the clock is read; the outputs
in docs/bench were measured with CUDA events, which leave out the host's launch time):

- the two-forward library path (:func:`kvnotes.ops.compose.compose`): ``StaticCache`` allocation and
  lazy init, prefix + seam forward, ``delta_rotations``, rotate + splice, suffix forward, and the
  whole call;
- the one-forward path: plan (token ids, slots), rotation matrices (cold), rotate + splice (one
  GEMM + one copy), eager forward, CUDA-graph replay, the whole :func:`compose_one_pass` call and
  the whole :class:`ComposeRunner` call;
- ``cpu_ms``: host time to issue a call (``perf_counter``, no synchronise at the end): when it
  is close to the CUDA-event time the call is bound by Python and kernel launches;
- ``--profiler``: ``torch.profiler`` top kernels of one call of each path at the longest length.

Also prints the largest logit difference and KL between the paths and the full prefill.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import numpy as np
import torch
from transformers import StaticCache

from kvnotes.ops import compose as kc
from kvnotes.bench.compose import add_layout_flags, gpu_model
from kvnotes.harness.timing import elapsed_ms
from kvnotes.cli.helptext import PlainHelpFormatter


def med(fn, warmup: int, trials: int) -> tuple[float, float]:
    """(median CUDA-event ms, median host ms to issue) of ``fn``."""
    for _ in range(warmup):
        fn()
    gpu, cpu = [], []
    for _ in range(trials):
        gpu.append(elapsed_ms(fn))
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        cpu.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(gpu), statistics.median(cpu)


def row(name: str, ms: tuple[float, float]) -> None:
    print(f"  {name:<44} {ms[0]:>9.2f} ms   cpu {ms[1]:>8.2f} ms", flush=True)


def section(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - report and go on with the other stages
        traceback.print_exc(file=sys.stdout)


@torch.no_grad()
def profile_length(model, L: int, args) -> None:
    rng = np.random.default_rng([args.seed, L])
    ids = torch.from_numpy(rng.integers(0, model.config.vocab_size, L)).long().cuda()
    P, M, s = args.prefix, args.suffix, args.seam
    prefix, chunk_ids, suffix = ids[:P], ids[P:L - M], ids[L - M:]
    chunk = kc.precompile(model, chunk_ids)
    n = len(chunk)
    parts = [prefix, chunk, suffix]
    W, T = args.warmup, args.trials
    print(f"\n== {L} tokens (prefix {P}, chunk {n}, suffix {M}, seam {s})", flush=True)

    # -- the two-forward library path, stage by stage
    def old_stages():
        state = {}

        def alloc():
            c = StaticCache(config=model.config, max_cache_len=L)
            for l, layer in enumerate(c.layers):
                layer.lazy_initialization(chunk.keys[l], chunk.values[l])
            state["cache"] = c

        def pre_fwd():
            kc._forward(model, state["cache"], torch.cat([prefix, chunk.ids[:s].cuda()]).view(1, -1), 0, False)

        def rots():
            state["rots"] = {P - chunk.start: kc.delta_rotations(model, P - chunk.start)}

        def splice():
            kc._splice_static(model, state["cache"], [chunk], [s], [True], P, state["rots"])

        def suf_fwd():
            kc._forward(model, state["cache"], suffix.view(1, -1), P + n, True)

        # the stages of one call, in order (each depends on the previous), timed one by one
        stages = [("StaticCache alloc + lazy init (zeros)", alloc), ("prefix + seam forward", pre_fwd),
                  ("delta_rotations", rots), ("rotate + splice (fp32 temporaries)", splice),
                  ("suffix forward (mask over all slots)", suf_fwd)]
        times = {name: [] for name, _ in stages}
        for trial in range(W + T):
            for name, fn in stages:
                ms = elapsed_ms(fn)
                if trial >= W:
                    times[name].append(ms)
        print(" compose() (two forwards), stage by stage:", flush=True)
        for name, _ in stages:
            print(f"  {name:<44} {statistics.median(times[name]):>9.2f} ms", flush=True)
        row("whole compose() call", med(lambda: kc.compose(model, parts, True, s), W, T))
    section(old_stages)

    # -- the one-forward path, stage by stage
    def new_stages():
        state = {"rc": {}}
        plan = kc._plan(model, parts, s, True)
        cache = kc.SlotCache.empty(model, 1, L)
        print(" one forward:", flush=True)
        row("plan (ids, slots: host->device)", med(lambda: kc._plan(model, parts, s, True), W, T))
        row("rotation matrices (cold: delta_rotations + R)",
            med(lambda: kc._rotations(model, P - chunk.start, torch.bfloat16, 128, {}), W, T))
        row("rotate (1 GEMM) + splice values (1 copy)",
            med(lambda: kc._splice_one_pass(model, cache, plan.chunks, True, state["rc"]), W, T))
        row("set_length (one fill per layer)", med(lambda: cache.set_length(L), W, T))
        row("eager forward (prefix+seam+suffix)",
            med(lambda: kc._forward_one_pass(model, cache, plan.ids, plan.slots, plan.runs), W, T))
        row("whole compose_one_pass (new cache)", med(lambda: kc.compose_one_pass(model, parts, True, s), W, T))
        cache = None                    # free the pool before the runner allocates its own
        runner = kc.ComposeRunner(model, L)
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner(parts, True, s)
        torch.cuda.synchronize()
        print(f"  {'first runner call (graph capture)':<44} {(time.perf_counter() - t) * 1e3:>9.2f} ms", flush=True)
        g = next(iter(runner._graphs.values()))
        row("graph replay (forward)", med(lambda: g.graph.replay(), W, T))
        row("whole ComposeRunner call (graph)", med(lambda: runner(parts, True, s), W, T))
        eager = kc.ComposeRunner(model, L, graphs=False)
        row("whole ComposeRunner call (eager)", med(lambda: eager(parts, True, s), W, T))

        # agreement between the paths and with the full prefill
        ref = kc.full_logits(model, ids)
        _, a = kc.compose(model, parts, True, s)
        _, b = kc.compose_one_pass(model, parts, True, s)
        _, c = runner(parts, True, s)
        for name, x in [("compose()", a), ("compose_one_pass", b), ("runner (graph)", c)]:
            m = kc.decision_metrics(ref, x)
            top1 = "agree" if bool(m["top1_agree"][0]) else "differ"
            print(f"  {name:<18} KL(full||.) {float(m['kl'][0]):.4f} top1 {top1}"
                  f"  max|logits - compose()| {float((x - a).abs().max()):.4f}", flush=True)
        if args.profiler and L == max(args.lengths):
            from torch.profiler import ProfilerActivity, profile
            for name, fn in [("compose()", lambda: kc.compose(model, parts, True, s)),
                             ("compose_one_pass", lambda: kc.compose_one_pass(model, parts, True, s)),
                             ("runner (graph)", lambda: runner(parts, True, s))]:
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
                ka = prof.key_averages()
                key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
                print(f"\n -- torch.profiler: {name}, {L} tokens (top kernels by self device time)", flush=True)
                print(ka.table(sort_by=key, row_limit=14, max_name_column_width=60), flush=True)
    section(new_stages)
    torch.cuda.empty_cache()


def main() -> None:
    """Profile (see the module docstring).

    Raises:
        KvnotesError: a bad flag (a count below its least value, a length not longer than prefix +
            suffix) or no CUDA device, before the model is built.
    """
    from kvnotes.errors import KvnotesError

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__.split("\n")[0])
    add_layout_flags(ap, lengths=[2048, 32768], warmup=2)
    ap.add_argument("--profiler", action="store_true", help='also print a torch.profiler table at the largest length')
    args = ap.parse_args()
    if min(args.lengths) <= args.prefix + args.suffix:
        raise KvnotesError(f"--lengths: each length must exceed --prefix + --suffix ({args.prefix + args.suffix}) "
                           f"to leave a chunk, got {min(args.lengths)}")
    if not torch.cuda.is_available():
        raise KvnotesError("bench compose-gpu needs a CUDA device (torch.cuda.is_available() is False)")
    model = gpu_model()
    print(f"# {' '.join(['python', *sys.argv])}\n# {torch.cuda.get_device_name()}; torch {torch.__version__}; "
          f"transformers {__import__('transformers').__version__}", flush=True)
    for L in args.lengths:
        profile_length(model, L, args)


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
