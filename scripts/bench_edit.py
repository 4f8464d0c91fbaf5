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

Timed per length (median of ``--trials`` after ``--warmup`` runs; CUDA events on GPU,
``time.perf_counter`` on CPU), each from the same stale cache prepared outside the timing:
``full`` (prefill of the new prompt, last-position logits only), ``refresh_field``, ``erratum``,
``field_plus_erratum``, ``hoist``, ``selective_last@K`` and ``selective_attention@K`` /
``selective_kv_deviation@K`` (ranking included) for ``--ks``. Printed: milliseconds, the speed-up
``full / method`` and the tokens each forwards. ``--json PATH`` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from kvnotes.cli import add_machine_flags

ROOT = Path(__file__).resolve().parent.parent

import torch

from kvnotes.kv.cache import AllSlotCache
from kvnotes.ops import edit
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
    filler = ids(n_tokens - 16 - 2 - 20)
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
    from scenarios.instances import PairSpec, draw_instances
    from scenarios.schema import load_scenario

    sc = load_scenario(ROOT / "scenarios/suites/recall/home_city.yaml")
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


def bench_length(model, lay: Layout, clock: Clock, ks: list[int], rankings: list[str]) -> list[dict]:
    """Time every method on one layout; rows ``{method, ms, tokens}``."""
    d, de, dh = len(lay.old) - 1, len(lay.erratum) - 1, len(lay.hoist_old) - 1
    b = lay.field[1]
    stale = AllSlotCache.prefill(model, lay.old[:d])
    hoist_cached = AllSlotCache.prefill(model, lay.hoist_old[:dh])
    token = int(lay.old[d])
    rows = []

    def add(name, fn, tokens):
        rows.append({"method": name, "ms": clock(fn), "tokens": tokens})

    add("full", lambda: edit.full(model, lay.new, d), d)
    add("refresh_field", lambda: edit.refresh_field(model, stale, lay.new, lay.field), b - lay.field[0])
    add("erratum", lambda: edit.extend_from(model, stale, lay.erratum, lay.erratum_reuse, de), de - lay.erratum_reuse)
    add("field_plus_erratum",
        lambda: edit.extend_from(model, edit.refresh_field(model, stale, lay.new, lay.field).cache, lay.erratum,
                                 lay.erratum_reuse, de), de - lay.erratum_reuse + b - lay.field[0])
    add("hoist", lambda: edit.extend_from(model, hoist_cached, lay.hoist_new, lay.hoist_reuse, dh), dh - lay.hoist_reuse)
    for k in ks:
        for ranking in rankings:
            def sel(ranking=ranking, k=k):
                ref = edit.refresh_field(model, stale, lay.new, lay.field)
                if ranking == "last":
                    order = edit.rank_last((b, d))
                elif ranking == "attention":
                    order, _ = edit.rank_attention(model, stale, token, (b, d))
                else:
                    order, _ = edit.rank_kv_deviation(model, ref, lay.new, (b, d))
                return edit.selective(model, ref, lay.new, order[:k])
            add(f"selective_{ranking}@{k}", sel, k + b - lay.field[0])
    full_ms = rows[0]["ms"]
    for r in rows:
        r["speedup"] = full_ms / r["ms"]
    return rows


def qwen3_8b_model():
    """Random-weight Qwen3-8B-shaped model in bf16 on the GPU (no download): the zoo entry's
    full-size architecture (:func:`kvnotes.models.zoo.random_model`)."""
    from kvnotes.models.zoo import random_model, zoo_config

    return random_model(zoo_config("qwen3-8b"), shrink=False, dtype=torch.bfloat16, device="cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_machine_flags(ap)      # --device cuda: a random Qwen3-8B-shaped bf16 model on CUDA
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt tokens (CPU 512 2048 8192; GPU 2048..32768)")
    ap.add_argument("--ks", type=int, nargs="+", default=[32], help="selective K values")
    ap.add_argument("--rankings", nargs="+", default=["last", "attention", "kv_deviation"])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    args.gpu = args.device == "cuda"
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
        bundle = load_model(OmegaConf.load(ROOT / "conf/model/smollm2-135m.yaml"), "cpu")
        model = bundle.model
        layouts = lambda n: scenario_layout(bundle, n)                        # noqa: E731
        device = f"CPU ({platform.processor() or platform.machine()}, {args.threads} thread(s))"
        model_name = "SmolLM2-135M-Instruct (fp32)"
    clock = Clock(args.trials, args.warmup)
    import transformers

    header = (f"# bench_edit: {model_name} on {device}; torch {torch.__version__}, transformers "
              f"{transformers.__version__}; attn {model.config._attn_implementation}; median of {args.trials} "
              f"after {args.warmup} warm-up\n# command: python {' '.join(sys.argv)}")
    print(header)
    out = {"model": model_name, "device": device, "torch": torch.__version__,
           "transformers": transformers.__version__, "command": " ".join(sys.argv), "lengths": {}}
    print(f"{'tokens':>7} {'method':<28} {'ms':>10} {'speedup':>8} {'forwarded':>9}")
    for n in lengths:
        lay = layouts(n)
        rows = bench_length(model, lay, clock, args.ks, args.rankings)
        out["lengths"][str(len(lay.old) - 1)] = rows
        for r in rows:
            print(f"{len(lay.old) - 1:>7} {r['method']:<28} {r['ms']:>10.1f} {r['speedup']:>7.1f}x {r['tokens']:>9}", flush=True)
        if args.gpu:
            torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
