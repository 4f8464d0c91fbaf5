#!/usr/bin/env python
"""Batched generation of V variants from one shared prefix cache against a per-variant loop.

    kvnotes bench generate [--variants 16] [--new-tokens 40] [--trials 3]        # CPU, embedded SmolLM2-135M
    kvnotes bench generate --device cuda --random-init qwen3-8b --prompt-len 2048  # GPU, random weights

The prefix is a prompt of the default suite (or ``--prompt-len`` random tokens with
``--random-init``); the V variants feed V different tokens at the decision position (the prompt's
top-V next tokens) and decode greedily for ``--new-tokens`` tokens with no marker, so every chain
runs to the end. Both arms call :func:`kvnotes.kv.generate.generate`: batched, once with
``V`` rows on the batch-1 prefix (an expanded view), and in a loop, once per variant. The script
checks that both arms generate the same tokens and prints the ratio of their median times, both
measured in this one run (``torch.utils.benchmark``). ``--json PATH`` writes the numbers.

Where a batched chain differs from its per-variant chain, the script finds the first step at which
they part and the margin there: the log-prob of the per-variant token minus that of the batched one,
in a teacher-forced batch-1 forward of the common prefix. A margin within :data:`TIE_NATS` of the
model's dtype is a near-tie that rounding of a different batch shape can flip (bf16 on a random-weight
model, whose next-token distributions are flat, has many); a larger one is an error (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from kvnotes import CONF_DIR
from kvnotes.cli import add_machine_flags
from kvnotes.cli.helptext import PlainHelpFormatter


#: Largest log-prob margin (nats) at a chains' parting step that counts as a near-tie, per dtype.
#: fp32: batched and batch-1 decodes agree to ~1e-5 (tests/helpers.py BATCH_TOL). bf16: a logit of
#: magnitude 4-8 is rounded to steps of 1/32 nats, and the batched decode, the per-variant decode and
#: the teacher-forced forward that measures the margin round differently; the bound is 8 such steps
#: (a random-weight Qwen3-8B shape on an H200 parted its 16 chains at margins of 0-6 steps). The exact
#: check is the fp32 run (``--dtype float32``), on CPU or GPU.
TIE_NATS = {torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.03}


def parting(model, prefix, first: int, d: int, a: list[int], b: list[int]) -> tuple[int, float]:
    """First step at which chains ``a`` (per-variant) and ``b`` (batched) of the variant fed ``first`` at
    position ``d`` differ, and the margin ``log p(a_t) - log p(b_t)`` there (teacher-forced batch-1
    forward of ``first`` and the common prefix on a view of ``prefix``). Chains that agree until one
    of them ends get an infinite margin."""
    from kvnotes.kv import cache as kvcache

    t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if t == min(len(a), len(b)):          # one chain stopped earlier: not a rounding tie
        return t, float("inf")
    fed = torch.tensor([first, *a[:t]])
    lp = kvcache.continuation_logprobs(model, kvcache.view(prefix, model.config), fed, d, last_only=True)[0, -1]
    return t, float(lp[a[t]] - lp[b[t]])


def main() -> None:
    """Run the benchmark (see the module docstring).

    Raises:
        KvnotesError: a bad flag (an unknown model or dtype, a count below its least value) before
            the model loads.
        SystemExit: 1 when the batched and per-variant chains differ beyond a near-tie.
    """
    from kvnotes.cli.errors import DTYPES, conf_name, int_at_least, one_of

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, prog=sys.argv[0], description=__doc__)
    add_machine_flags(ap)
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"),
                    help="conf/model entry (its weights; see --random-init)")
    ap.add_argument("--random-init", metavar="MODEL", type=conf_name("model", "--random-init"),
                    help="the full-size shape of this zoo entry, random weights")
    ap.add_argument("--prompt-len", type=int_at_least("--prompt-len", 2), default=2048, help="--random-init: prompt tokens")
    ap.add_argument("--dtype", default=None, type=one_of("--dtype", DTYPES),
                    help=f"--random-init: torch dtype ({', '.join(DTYPES)}; default float32, bfloat16 on CUDA)")
    ap.add_argument("--variants", type=int_at_least("--variants", 1), default=16, help='V: variants decoded from the one prefix')
    ap.add_argument("--new-tokens", type=int_at_least("--new-tokens", 1), default=40, help='tokens generated per chain')
    ap.add_argument("--trials", type=int_at_least("--trials", 1), default=3, help='timed trials per arm (median reported)')
    ap.add_argument("--warmup", type=int_at_least("--warmup", 0), default=1, help='untimed runs first')
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from omegaconf import OmegaConf

    from kvnotes.kv.generate import generate, token_marker
    from kvnotes.harness.timing import time_calls
    from kvnotes.kv import cache as kvcache

    if args.random_init:
        from kvnotes.models.zoo import random_model, zoo_config

        dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device == "cuda" else torch.float32)
        model = random_model(zoo_config(args.random_init), shrink=False, seed=0, dtype=dtype, device=args.device)
        ids = torch.randint(0, model.config.get_text_config().vocab_size, (args.prompt_len,),
                            generator=torch.Generator().manual_seed(0))
        name = f"{args.random_init} shape, random weights ({dtype})"
    else:
        from kvnotes.harness.pairs import prepare_pairs
        from kvnotes.models.loading import load_model

        bundle = load_model(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml"), args.device)
        model = bundle.model
        sc = OmegaConf.load(CONF_DIR / "scenario/default.yaml")
        ids = prepare_pairs(bundle.tokenizer, sc).pairs[0].old.ids
        name = f"{args.model} ({next(model.parameters()).dtype})"
    d = len(ids) - 1
    prefix = kvcache.prefill(model, ids[:d])
    lp = kvcache.continuation_logprobs(model, kvcache.view(prefix, model.config), ids[d:], d)[0, -1]
    firsts = lp.topk(args.variants).indices.cpu()
    never = token_marker([-1])

    def batched():
        return generate(model, prefix, firsts, d, args.new_tokens, never)

    def loop():
        return [generate(model, prefix, int(t), d, args.new_tokens, never) for t in firsts]

    tb, gb = time_calls(batched, args.warmup, args.trials)
    tl, gl = time_calls(loop, args.warmup, args.trials)
    same = [c.ids for c in gb.chains] == [g.chains[0].ids for g in gl]
    parted = {i: parting(model, prefix, int(firsts[i]), d, g.chains[0].ids, c.ids)
              for i, (c, g) in enumerate(zip(gb.chains, gl)) if c.ids != g.chains[0].ids}
    tie = TIE_NATS.get(next(model.parameters()).dtype, 1e-4)
    worst = max((abs(m) for _, m in parted.values()), default=0.0)
    ratio = tl.median_ms / tb.median_ms
    load = os.getloadavg()[0]
    print(f"# bench_generate: {name} on {args.device} ({platform.machine()}, {torch.get_num_threads()} thread(s)); "
          f"prompt {d + 1} tokens, V={args.variants}, {args.new_tokens} new tokens, greedy; median of {args.trials} "
          f"after {args.warmup} warm-up; load average {load:.1f}")
    print(f"batched   {tb.median_ms:10.1f} ms")
    print(f"loop      {tl.median_ms:10.1f} ms")
    print(f"ratio     {ratio:10.2f}x   same greedy tokens: {same}")
    if parted:
        print(f"chains    {args.variants - len(parted)}/{args.variants} identical; the others part at steps "
              f"{sorted(t for t, _ in parted.values())} with margins up to {worst:.3g} nats (near-tie bound "
              f"{tie:g} for {next(model.parameters()).dtype})")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": name, "device": args.device, "threads": torch.get_num_threads(),
                                               "prompt_tokens": d + 1, "variants": args.variants,
                                               "new_tokens": args.new_tokens, "batched": tb.as_dict(),
                                               "loop": tl.as_dict(), "ratio": ratio, "same_tokens": same,
                                               "parted": {str(i): {"step": t, "margin_nats": m}
                                                          for i, (t, m) in parted.items()},
                                               "tie_nats": tie,
                                               "load_average": load, "command": " ".join(sys.argv)}, indent=1))
    if worst > tie:
        sys.exit(f"kvnotes: error: batched and per-variant chains differ where the model is not near a tie "
                 f"(margin {worst:.3g} nats > {tie:g})")


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
