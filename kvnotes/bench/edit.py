#!/usr/bin/env python
"""Wall time of every cache edit of :mod:`kvnotes.ops.edit` against a full re-prefill, in one run.

    OMP_NUM_THREADS=1 kvnotes bench edit                       # CPU, embedded SmolLM2-135M
    kvnotes bench edit --device cuda --lengths 2048 8192 16384 32768   # GPU, random Qwen3-8B shape

**CPU** (default): the embedded SmolLM2-135M on a recall scenario (``home_city``) whose filler is
repeated until the prompt has about ``--lengths`` tokens (512, 2k, 8k); the pair changes the field
(Paris -> London), the erratum and hoisted prompts come from :mod:`kvnotes.harness.edit_prompts`.

**GPU** (``--device cuda``): a random-weight model from a Qwen3-8B-shaped ``Qwen3Config`` (hidden 4096, 36
layers, 32 heads, 8 KV heads, head_dim 128, intermediate 12288, vocab 151936, rope_theta 1e6) in
bf16, built with ``AutoModelForCausalLM.from_config`` (no weights, no tokenizer). Prompts are
random token ids with the same layout as the scenario (a 16-token head, a 2-token field, filler, a
20-token request + decision block; the erratum is 30 tokens inserted before that block; the hoisted
layout has the field just before it). This path imports neither hydra/omegaconf nor nnsight.

Timed per length (median of ``--trials`` after ``--warmup`` runs, :func:`kvnotes.harness.timing.time_calls`:
the device synchronised before the clock is read), each from the same stale cache prepared outside
the timing: every method of the edit-method registry (:data:`kvnotes.ops.methods.METHODS`) that
recomputes and whose prompt this layout offers (erratum, hoist), controls excepted, each an eager
operation of :mod:`kvnotes.ops.edit` (:func:`kvnotes.ops.methods.run`): today ``full`` (prefill of the
new prompt, last-position logits only; the reference, first), ``refresh_field``, ``erratum``,
``field_plus_erratum``, ``hoist`` and ``selective_<ranking>@K`` for ``--ks`` and ``--rankings``
(``last``, ``attention``, ``kv_deviation``; ranking included); then (unless ``--no-pool``) the same
edits on an :class:`kvnotes.ops.edit_runner.EditRunner` (``[pool]`` rows; a ranked method with the
rankings that run no forward, ``last``: kept positions copied into a reused KV
pool, one forward, a CUDA graph on GPU captured in the warm-up), each checked once, untimed, against
the eager operation's decision log-probs (and, where the decision position is the stale one's, how far
the edit moves them). Printed: milliseconds, the speed-up
``full / method`` and the tokens each forwards, and each method's **floor** and measured / floor.
The floor (:func:`kvnotes.harness.roofline.forward_floor_s`) is the least time of the forwards the
method must make: ONE forward of the recomputed tokens against the cache they attend to, the
method's cost model (:meth:`kvnotes.ops.methods.EditMethod.cost`; an edit of several spans can be
one forward, as the ``[pool]`` rows do; for ``selective@K`` the K tokens at their earliest possible
positions; rankings not counted): the larger of their FLOPs at the
machine's best GEMM rate and their bytes (every weight once, the attended KV once, the LM head for
the one decision row) at its best weight-read rate, both rates measured in the same process before and
after the timings (:func:`kvnotes.harness.roofline.machine_rates`, best of the two). Copies that an
out-of-place edit makes of the stale cache are not in the floor. ``--json PATH`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from kvnotes import CONF_DIR
from kvnotes.scenarios.schema import SUITES_DIR
from kvnotes.cli import add_machine_flags
from kvnotes.cli.helptext import PlainHelpFormatter


import torch

from kvnotes.harness.roofline import forward_floor_s, machine_rates
from kvnotes.kv.cache import AllSlotCache
from kvnotes.ops import edit, methods
from kvnotes.ops.edit_runner import EditRunner
from kvnotes.harness.timing import time_calls


@dataclass
class Layout:
    """Token ids of one benchmark prompt family (all 1-D long tensors)."""

    old: torch.Tensor          # old prompt, decision at len - 1
    new: torch.Tensor          # new prompt (field changed), token-aligned with old
    field: tuple[int, int]
    erratum: torch.Tensor      # old prompt with the erratum inserted
    erratum_reuse: int
    hoist_old: torch.Tensor    # hoisted layout, old / new value
    hoist_new: torch.Tensor
    hoist_reuse: int


def synthetic_layout(n_tokens: int, vocab: int, seed: int = 0) -> Layout:
    """Random-id prompts with the scenario layout (see module docstring)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(10, vocab, (n,), generator=g)            # noqa: E731
    head, field, block, notice = ids(16), ids(2), ids(20), ids(30)
    filler = ids(n_tokens - SYNTHETIC_FIXED)
    new_field = (field + 1) % vocab
    old = torch.cat([head, field, filler, block])
    new = torch.cat([head, new_field, filler, block])
    cut = len(old) - len(block)
    erratum = torch.cat([old[:cut], notice, old[cut:]])
    hoist_old = torch.cat([filler, head, field, block])
    hoist_new = torch.cat([filler, head, new_field, block])
    return Layout(old, new, (16, 18), erratum, cut, hoist_old, hoist_new, len(filler) + 16)


def scenario_layout(bundle, n_tokens: int) -> Layout:
    """A filler-extended ``home_city`` pair (Paris -> London) of about ``n_tokens`` tokens."""
    from kvnotes.harness.tokens import tokenize_pair
    from kvnotes.harness import edit_prompts as sedits
    from kvnotes.scenarios.instances import PairSpec, draw_instances
    from kvnotes.scenarios.schema import load_scenario

    sc = load_scenario(SUITES_DIR / "recall/home_city.yaml")
    base = draw_instances(sc, 1, 0)[0]
    tok = bundle.tokenizer

    def pair_with(n_filler):
        inst = replace(base, filler=tuple(sc.filler[i % len(sc.filler)] for i in range(n_filler)))
        tp = tokenize_pair(tok, PairSpec(inst, "Paris", "London", "direct", " Paris", " London", True))
        if isinstance(tp, str):
            raise RuntimeError(f"benchmark pair excluded: {tp}")
        return inst, tp

    _, p1 = pair_with(1)
    _, p2 = pair_with(41)
    per = (len(p2.old.ids) - len(p1.old.ids)) / 40
    inst, tp = pair_with(max(1, round(1 + (n_tokens - len(p1.old.ids)) / per)))
    err = sedits.edited_prompt(tok, inst, "Paris", tp.old, notice=sedits.erratum_text(inst, "London"))
    h_old, h_new = sedits.hoisted_pair(tok, inst, "Paris", "London")
    return Layout(tp.old.ids, tp.new.ids, tp.field, err.prompt.ids, err.reuse, h_old.ids, h_new.prompt.ids,
                  h_new.reuse)


@dataclass
class Clock:
    """Median wall milliseconds of ``trials`` calls after ``warmup`` (:func:`time_calls`)."""

    trials: int
    warmup: int

    def __call__(self, fn) -> float:
        return time_calls(fn, self.warmup, self.trials)[0].median_ms


def floor_ms(model, rates: tuple[float, float], spans: list[tuple[int, int]], cached: int) -> float:
    """Floor (ms) of ONE forward of the positions ``spans`` (each ``(start, end)``, causal within it)
    against ``cached`` cached positions, one decision row through the LM head
    (:func:`kvnotes.harness.roofline.forward_floor_s`): an edit that recomputes several spans can
    do it in one forward (:mod:`kvnotes.ops.edit_runner`), so its weights are read once."""
    nbytes = next(model.parameters()).element_size()
    n = sum(end - start for start, end in spans)
    pairs = sum(edit.span_pairs(start, end) for start, end in spans)
    return 1e3 * forward_floor_s(model.config, rates, nbytes, n, pairs, cached, logit_rows=1)


def bench_length(model, lay: Layout, clock: Clock, ks: list[int], rankings: list[str],
                 runner: EditRunner | None = None) -> list[dict]:
    """Time every method of the registry (:data:`kvnotes.ops.methods.METHODS`) this layout offers on
    one layout: the reference first, then each method that recomputes (not a control) in registry
    order, a ranked one for each K and ranking; rows ``{method, ms, tokens, spans, cached}`` (its
    cost model, :meth:`kvnotes.ops.methods.EditMethod.cost`, which its floor counts, :func:`floor_ms`).
    With ``runner``, also each edit on its pool (``[pool]`` rows, :meth:`EditRunner.apply`; a ranked
    method with each ranking that runs no forward), with the largest difference of its decision
    log-probs from the eager operation's (``max_logprob_diff``, one untimed call each)."""
    d, de, dh = len(lay.old) - 1, len(lay.erratum) - 1, len(lay.hoist_old) - 1
    stale = AllSlotCache.prefill(model, lay.old[:d])
    hoist_cached = AllSlotCache.prefill(model, lay.hoist_old[:dh])
    src = methods.EditSource(model, stale, lay.new, lay.field, d, int(lay.old[d]),
                             {"erratum": methods.Prompted(stale, lay.erratum, lay.erratum_reuse, de),
                              "hoist": methods.Prompted(hoist_cached, lay.hoist_new, lay.hoist_reuse, dh)})
    controls = methods.controls()
    timed = [methods.METHODS[methods.REFERENCE]] + [
        m for m in methods.METHODS.values()
        if m.recomputes and not m.reprefill and m.name not in controls and src.supports(m)]
    # (row name, method, K, ranking): the plain methods, then each ranked one per K and ranking
    variants = [(m.name, m, 0, None) for m in timed if not m.ranked]
    variants += [(m.variant(r, k), m, k, r) for m in timed if m.ranked for k in ks for r in rankings]
    rows = []

    def add(name, fn, cost):
        rows.append({"method": name, "ms": clock(fn), "tokens": cost["tokens"], "spans": cost["spans"],
                     "cached": cost["cached"]})

    for name, m, k, r in variants:
        # a ranked method's k rows at their earliest possible positions, against the whole cache
        cost = m.cost(src.geometry(m), k)
        add(name, lambda m=m, k=k, r=r: methods.run(m, src.fresh(), k, r),
            {"tokens": cost.tokens, "spans": list(cost.spans), "cached": cost.cached})
    if runner is not None:
        for name, m, k, r in variants:
            ranking = methods.RANKINGS.get(r or "")
            if m.reprefill or (ranking is not None and (ranking.forwards or ranking.seeded)):
                continue                  # a ranking that runs the model is timed eagerly only
            ranked = ranking.rank(src) if ranking is not None else None
            picks = ranked[0][:k] if ranked is not None else ()
            base = next(row for row in rows if row["method"] == name)
            e, tok = methods.apply(m, src.fresh(), k, ranked)
            ref = edit.decision_logprobs(model, e.cache, tok, e.pos)
            got = edit.decision_logprobs(model, runner.apply(m, src, picks)[0].all_slot_view(e.pos), tok, e.pos)
            add(f"{name} [pool]", lambda m=m, picks=picks: runner.apply(m, src, picks), base)
            rows[-1]["max_logprob_diff"] = float((got - ref).abs().max())
            rows[-1]["top1_agree"] = bool(got.argmax() == ref.argmax())
            if m.prompt is None:
                # the stale prompt's decision, same position: how far the edit moves it (the scale of the check)
                rows[-1]["edit_effect"] = float((ref - edit.decision_logprobs(model, stale, tok, d)).abs().max())
    full_ms = rows[0]["ms"]
    for r in rows:
        r["speedup"] = full_ms / r["ms"]
    return rows


def qwen3_8b_model():
    """Random-weight Qwen3-8B-shaped model in bf16 on the GPU (no download): the zoo entry's
    full-size architecture (:func:`kvnotes.models.zoo.random_model`)."""
    from kvnotes.models.zoo import random_model, zoo_config

    return random_model(zoo_config("qwen3-8b"), shrink=False, dtype=torch.bfloat16, device="cuda")


#: Rankings :func:`bench_length` can time: the registry's that need no random generator.
RANKINGS = tuple(name for name, r in methods.RANKINGS.items() if not r.seeded)
#: Fixed tokens of the GPU path's synthetic layout (head, field, request block): a length needs more.
SYNTHETIC_FIXED = 16 + 2 + 20


def main() -> None:
    """Run the benchmark (see the module docstring).

    Raises:
        KvnotesError: a bad flag (a length, K or trial count below 1, a negative warm-up, an unknown
            ranking, device or ``--json`` path), before the model loads or anything is printed.
    """
    from kvnotes.cli.errors import int_at_least, one_of
    from kvnotes.errors import KvnotesError

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__.split("\n\n")[0])
    add_machine_flags(ap)      # --device cuda: a random Qwen3-8B-shaped bf16 model on CUDA
    ap.add_argument("--lengths", type=int_at_least("--lengths", 1), nargs="+", default=None,
                    help="prompt tokens (CPU 512 2048 8192; GPU 2048..32768)")
    ap.add_argument("--ks", type=int_at_least("--ks", 1), nargs="+", default=[32], help="selective K values")
    ap.add_argument("--rankings", type=one_of("--rankings", RANKINGS), nargs="+", default=list(RANKINGS),
                    help=f"selective rankings ({', '.join(RANKINGS)})")
    ap.add_argument("--trials", type=int_at_least("--trials", 1), default=3, help='timed trials per operation (median reported)')
    ap.add_argument("--warmup", type=int_at_least("--warmup", 0), default=1, help='untimed runs first')
    ap.add_argument("--no-pool", action="store_true", help="skip the [pool] rows (kvnotes.ops.edit_runner)")
    args = ap.parse_args()
    args.gpu = args.device == "cuda"
    if args.gpu and args.lengths and min(args.lengths) <= SYNTHETIC_FIXED:
        raise KvnotesError(f"--lengths: the GPU layout needs more than {SYNTHETIC_FIXED} tokens, got {min(args.lengths)}")
    args.out = Path(args.json) if args.json else None
    torch.set_num_threads(args.threads)
    if args.gpu:
        lengths = args.lengths or [2048, 8192, 16384, 32768]
        model = qwen3_8b_model()
        layouts = lambda n: synthetic_layout(n, model.config.vocab_size)      # noqa: E731
        device = torch.cuda.get_device_name(0)
        model_name = "random Qwen3-8B-shaped (bf16)"
    else:
        from omegaconf import OmegaConf

        from kvnotes.models.loading import load_model

        lengths = args.lengths or [512, 2048, 8192]
        bundle = load_model(OmegaConf.load(CONF_DIR / "model/smollm2-135m.yaml"), "cpu")
        model = bundle.model
        layouts = lambda n: scenario_layout(bundle, n)                        # noqa: E731
        device = f"CPU ({platform.processor() or platform.machine()}, {args.threads} thread(s))"
        model_name = "SmolLM2-135M-Instruct (fp32)"
    clock = Clock(args.trials, args.warmup)
    rates_rows = 8192 if args.gpu else 1024
    rates = [machine_rates(model, rows=rates_rows)]
    import transformers

    header = (f"# bench_edit: {model_name} on {device}; torch {torch.__version__}, transformers "
              f"{transformers.__version__}; attn {model.config._attn_implementation}; median of {args.trials} "
              f"after {args.warmup} warm-up\n# command: python {' '.join(sys.argv)}")
    print(header)
    out = {"model": model_name, "device": device, "torch": torch.__version__,
           "transformers": transformers.__version__, "command": " ".join(sys.argv), "lengths": {}}
    print(f"{'tokens':>7} {'method':<28} {'ms':>10} {'speedup':>8} {'forwarded':>9}")
    results = []
    for n in lengths:
        lay = layouts(n)
        runner = None if args.no_pool else EditRunner(model, len(lay.erratum) + 1, graphs=args.gpu)
        rows = bench_length(model, lay, clock, args.ks, args.rankings, runner)
        del runner
        out["lengths"][str(len(lay.old) - 1)] = rows
        results.append((len(lay.old) - 1, rows))
        for r in rows:
            check = (f"  logprobs within {r['max_logprob_diff']:.2g} of the eager op's, top-1 "
                     f"{'agrees' if r['top1_agree'] else 'DIFFERS'}" if "max_logprob_diff" in r else "")
            if "edit_effect" in r:
                check += f" (the edit moves them by up to {r['edit_effect']:.2g})"
            print(f"{len(lay.old) - 1:>7} {r['method']:<28} {r['ms']:>10.1f} {r['speedup']:>7.1f}x {r['tokens']:>9}"
                  f"{check}", flush=True)
        if args.gpu:
            torch.cuda.empty_cache()
    rates.append(machine_rates(model, rows=rates_rows))
    best = (max(r[0] for r in rates), max(r[1] for r in rates))
    out["rates_before_after"] = rates
    print(f"# floors at the best rates measured before and after the timings: {best[0] / 1e12:.3f} TFLOP/s "
          f"(GEMM), {best[1] / 1e9:.1f} GB/s (weight read); before {rates[0][0] / 1e12:.3f} / {rates[0][1] / 1e9:.1f}, "
          f"after {rates[1][0] / 1e12:.3f} / {rates[1][1] / 1e9:.1f}")
    print(f"{'tokens':>7} {'method':<28} {'ms':>10} {'floor_ms':>9} {'x_floor':>8}")
    for n, rows in results:
        for r in rows:
            r["floor_ms"] = floor_ms(model, best, r["spans"], r["cached"])
            r["over_floor"] = r["ms"] / r["floor_ms"]
            print(f"{n:>7} {r['method']:<28} {r['ms']:>10.1f} {r['floor_ms']:>9.2f} {r['over_floor']:>7.1f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
