#!/usr/bin/env python
"""Time to first token: a composed prompt against its full prefill, as the context grows (paper §5).

    OMP_NUM_THREADS=1 kvnotes bench compose                       # CPU, embedded SmolLM2-135M
    OMP_NUM_THREADS=1 kvnotes bench compose --image --threads 1   # CPU, image rows (random shrunk Qwen3-VL-2B)
    kvnotes bench compose --device cuda --lengths 2048 4096 8192 16384 32768   # random Qwen3-8B-shaped, bf16

A prompt of ``L`` tokens is a live prefix (``--prefix`` tokens), one precompiled chunk, and a live
suffix (``--suffix`` tokens: state update + question); the chunk fills the rest. Token ids are drawn
at random from the vocabulary with a seeded generator (the time of a forward does not depend on
which tokens it sees). Per length, in one process:

- **full**: prefill of all ``L`` tokens computing only the last position's logits
  (:func:`kvnotes.ops.compose.full_logits`);
- **composed** (:class:`kvnotes.ops.compose.ComposeRunner`, the serving path): the chunk's keys rotated
  by one GEMM and written with its values into a KV pool, then ONE forward of the prefix, the
  ``--seam`` recomputed chunk tokens and the suffix at their positions (each attends to every slot
  before its own), last position's logits. The pool (``max(--lengths)`` slots) is allocated once and
  reused by every call, as a serving engine's KV pool is: each call rewrites every slot it reads.
  Rotation matrices are cached per delta. On GPU the forward is a CUDA graph captured once per
  token layout in its first call (``first_call_ms``, not part of the composed time, like a
  compile); the splice runs eagerly before each replay (``--no-graphs``: eager forward);
- **one_pass** (:func:`kvnotes.ops.compose.compose_one_pass`): the same one forward, eager, with a
  new cache allocated in the call (``torch.empty``) and rotation matrices built in the call;
- **compose()** (:func:`kvnotes.ops.compose.compose`, the library's general path, the "before"):
  prefix + seam forward on a new ``StaticCache``, rotated keys written in place, suffix forward;
- **precompile**: the chunk's own prefill (:func:`kvnotes.ops.compose.precompile`), done once per
  chunk and reported separately (not part of the composed times).

Full and each composed path are run ``--warmup`` times untimed, then ``--trials`` timed; medians
are printed with the ratio full / composed (precompile: one timed run on CPU; on GPU one warm-up and
``trials // 2`` timed). On GPU the timings are CUDA events around each call (after a synchronise). The
``--device cuda`` path builds a random-weight model from a Qwen3-8B-shaped config in bf16
(``AutoModelForCausalLM.from_config`` on the GPU, no weights) and imports neither hydra nor nnsight.
``--json PATH`` writes the table with the command line and environment. KL(full||composed) and
top-1 agreement compare the composed path's logits with the full prefill's (same tokens); the JSON
also has them for compose() and the largest logit difference between the two composed paths.
A second table gives each path's roofline floor (:func:`floors_ms`, at the machine's best rates
measured in the same process before and after the timings, :func:`kvnotes.harness.roofline.machine_rates`)
and measured / floor.

**Image rows** (``--image``; issue #24 item 3): time to first token of ``prefix | image | suffix`` on
an M-RoPE vision-language model, with and without re-encoding the image. The model is the zoo
entry ``--vlm`` (default ``qwen3-vl-2b``) with random weights, shrunk as the conformance lane
shrinks it (:func:`kvnotes.models.zoo.random_model`); the image is a seeded random-pixel grid
(``--grids``, in patches; :func:`kvnotes.ops.mrope.synthetic_image`). Per grid, in one process:

- **full (re-encode)**: one forward of the whole prompt with its pixels (vision tower + prefill),
  3-D positions from the model's ``get_rope_index``;
- **composed**: :func:`kvnotes.ops.compose.compose` of the live prefix, the image chunk (encoded
  once, beforehand, at other positions: behind nothing at 0..) moved by its 3-D delta, and the live
  suffix: no pixels reach it;
- **precompile**: encoding the image into its chunk (vision tower + the image tokens' prefill), once.

KL(full||composed) differs from 0 also with exact re-positioning: in the full prefill the image
tokens attend to the prefix, in the chunk they do not.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

from kvnotes import CONF_DIR
from kvnotes.cli import add_machine_flags
from kvnotes.cli.helptext import PlainHelpFormatter


import numpy as np
import torch
import transformers

from kvnotes.ops import compose as kvcompose
from kvnotes.ops.edit import span_pairs
from kvnotes.harness.roofline import forward_floor_s, kv_bytes, machine_rates
from kvnotes.harness.timing import elapsed_ms, time_calls

def gpu_model():
    """A random-weight Qwen3-8B-shaped causal LM in bf16, built directly on the GPU (the zoo entry's
    full-size architecture, :func:`kvnotes.models.zoo.random_model`)."""
    from kvnotes.models.zoo import random_model, zoo_config

    return random_model(zoo_config("qwen3-8b"), shrink=False, dtype=torch.bfloat16, device="cuda")


def embedded_model(name: str):
    from omegaconf import OmegaConf

    from kvnotes.models.loading import load_model

    return load_model(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"), "cpu").model


def floors_ms(model, rates: tuple[float, float], L: int, n_prefix: int, n_suffix: int, seam: int) -> dict:
    """Roofline floors (ms, :func:`kvnotes.harness.roofline.forward_floor_s`) of the two paths at
    ``rates``: **full**, the causal prefill of ``L`` tokens with one logit row; **composed**, one forward
    of the prefix, seam and suffix tokens at their positions reading the chunk's other cached K/V once,
    plus rotating the chunk's keys (read and write once)."""
    cfg, nbytes = model.config, next(model.parameters()).element_size()
    live_from = L - n_suffix - seam
    chunk = live_from - n_prefix
    full = forward_floor_s(cfg, rates, nbytes, L, span_pairs(0, L), 0, logit_rows=1)
    composed = forward_floor_s(cfg, rates, nbytes, n_prefix + seam + n_suffix,
                               span_pairs(0, n_prefix) + span_pairs(live_from, L), chunk, logit_rows=1,
                               extra_bytes=kv_bytes(cfg, chunk, nbytes))   # keys: half of K/V, read + write
    return {"full_floor_ms": 1e3 * full, "composed_floor_ms": 1e3 * composed}


def timed(fn, warmup: int, trials: int) -> tuple[dict, Any]:
    """Median/min of ``trials`` timed calls after ``warmup`` untimed ones (:func:`time_calls`); also
    the last result."""
    timing, res = time_calls(fn, warmup, trials)
    return timing.as_dict(), res


@torch.no_grad()
def bench_length(model, L: int, n_prefix: int, n_suffix: int, seam: int, warmup: int, trials: int,
                 cuda: bool, seed: int, runner: kvcompose.ComposeRunner) -> dict:
    rng = np.random.default_rng([seed, L])
    vocab = model.config.get_text_config().vocab_size
    ids = torch.from_numpy(rng.integers(0, vocab, L)).long().to(model.device)
    prefix, chunk_ids, suffix = ids[:n_prefix], ids[n_prefix:L - n_suffix], ids[L - n_suffix:]
    pre, chunk = timed(lambda: kvcompose.precompile(model, chunk_ids), 1 if cuda else 0,
                       max(1, trials // 2) if cuda else 1)
    full, ref = timed(lambda: kvcompose.full_logits(model, ids), warmup, trials)
    parts = [prefix, chunk, suffix]
    # first call of this layout: on GPU it captures the CUDA graph (a warm-up, timed apart, excluded)
    first_ms = elapsed_ms(lambda: runner(parts, True, seam))
    comp, (_, got) = timed(lambda: runner(parts, True, seam), warmup, trials)
    one, (_, got_one) = timed(lambda: kvcompose.compose_one_pass(model, parts, True, seam), warmup, trials)
    api, (_, got_api) = timed(lambda: kvcompose.compose(model, parts, True, seam), warmup, trials)
    # the composed and full runs see the same tokens: how far apart are their next-token distributions
    m = kvcompose.decision_metrics(ref, got)
    m_api = kvcompose.decision_metrics(ref, got_api)
    del chunk
    if cuda:
        torch.cuda.empty_cache()
    return {"length": L, "chunk_tokens": int(chunk_ids.numel()), "full": full, "composed": comp,
            "one_pass": one, "compose_api": api, "precompile": pre, "first_call_ms": first_ms,
            "ratio_full_over_composed": full["median_ms"] / comp["median_ms"],
            "ratio_full_over_compose_api": full["median_ms"] / api["median_ms"],
            "kl_full_composed": float(m["kl"][0]), "top1_agree": bool(m["top1_agree"][0]),
            "kl_full_compose_api": float(m_api["kl"][0]), "top1_agree_compose_api": bool(m_api["top1_agree"][0]),
            "max_abs_logit_diff_composed_vs_api": float((got - got_api).abs().max()),
            "max_abs_logit_diff_one_pass_vs_api": float((got_one - got_api).abs().max())}


@torch.no_grad()
def bench_image(model, grid: tuple[int, int, int], n_prefix: int, n_suffix: int, warmup: int, trials: int,
                seed: int) -> dict:
    """One image row: full prefill with the pixels re-encoded vs the precompiled image chunk composed
    (see the module docstring); times in ms (medians of ``trials`` after ``warmup``)."""
    from kvnotes.ops import mrope

    img, inputs = mrope.synthetic_image(model, grid, seed)
    rng = np.random.default_rng([seed, *grid])
    text = torch.from_numpy(rng.integers(0, min(model.config.get_text_config().vocab_size, 32000), n_prefix + n_suffix))
    prefix, suffix = text[:n_prefix].long(), text[n_prefix:].long()
    ids = torch.cat([prefix, img, suffix])
    dev = model.device

    def full_fn():
        pos = mrope.positions(model, ids, image_grid_thw=inputs["image_grid_thw"])
        out = model(input_ids=ids.view(1, -1).to(dev), position_ids=pos.unsqueeze(1), logits_to_keep=1, **inputs)
        return out.logits[:, -1].float()

    pre, chunk = timed(lambda: kvcompose.precompile(model, img, **inputs), 0, 1)
    full, ref = timed(full_fn, warmup, trials)
    comp, (_, got) = timed(lambda: kvcompose.compose(model, [prefix, chunk, suffix]), warmup, trials)
    m = kvcompose.decision_metrics(ref, got)
    return {"grid": list(grid), "image_tokens": len(img) - 2, "length": int(ids.numel()), "full": full,
            "composed": comp, "precompile": pre, "ratio_full_over_composed": full["median_ms"] / comp["median_ms"],
            "kl_full_composed": float(m["kl"][0]), "top1_agree": bool(m["top1_agree"][0])}


def image_main(args) -> None:
    """``--image``: the image rows (module docstring), printed as a table."""
    from kvnotes.models.zoo import random_model, zoo_config

    model = random_model(zoo_config(args.vlm))
    grids = [tuple(int(x) for x in g.split("x")) for g in (args.grids or ["1x16x16", "1x32x32", "1x64x64"])]
    text, vision = model.config.get_text_config(), model.config.vision_config
    header = (f"# {' '.join(['python', *sys.argv])}\n# model: {args.vlm}, RANDOM weights, shrunk as the zoo lane shrinks "
              f"it (text {text.num_hidden_layers} layers x {text.hidden_size} wide, vision tower {vision.depth} layer(s) x "
              f"{vision.hidden_size} wide); device: cpu ({platform.processor() or platform.machine()}, {args.threads} "
              f"thread(s)); torch {torch.__version__}; transformers {transformers.__version__}; dtype "
              f"{next(model.parameters()).dtype}\n# prefix {args.prefix} + image + suffix {args.suffix} tokens; synthetic "
              f"image (seeded random pixels); warm-up {args.warmup}; {args.trials} trials; medians in ms\n"
              f"# full = one forward with the pixels (vision tower re-encodes the image); composed = compose() of "
              f"the precompiled image chunk (moved by its 3-D delta) between live text")
    print(header, flush=True)
    print(f"{'grid':>9} {'img_tok':>7} {'tokens':>6} {'full_ms':>9} {'composed_ms':>11} {'ratio':>6} "
          f"{'precompile_ms':>13} {'KL(full||comp)':>14} top1", flush=True)
    out = []
    for g in grids:
        r = bench_image(model, g, args.prefix, args.suffix, args.warmup, args.trials, args.seed)
        out.append(r)
        print(f"{'x'.join(map(str, g)):>9} {r['image_tokens']:>7} {r['length']:>6} {r['full']['median_ms']:>9.1f} "
              f"{r['composed']['median_ms']:>11.1f} {r['ratio_full_over_composed']:>6.1f} "
              f"{r['precompile']['median_ms']:>13.1f} {r['kl_full_composed']:>14.4f} "
              f"{'agree' if r['top1_agree'] else 'differ'}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"header": header, "args": vars(args), "rows": out}, indent=1))


def grid_arg(text: str) -> str:
    """An argparse ``type`` for ``--grids``: ``TxHxW``, three positive integers (patches).

    Raises:
        KvnotesError: another form.
    """
    from kvnotes.errors import KvnotesError

    parts = text.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise KvnotesError(f"--grids: expected TxHxW (three positive integers, e.g. 1x16x16), got '{text}'")
    return text


def add_layout_flags(ap, lengths: list[int] | None, warmup: int) -> None:
    """The flags of a composed prompt's layout and its timing, shared with ``bench compose-gpu``:
    ``--lengths`` (default ``lengths``; None: the device's list), ``--prefix``, ``--suffix``,
    ``--seam``, ``--warmup`` (default ``warmup``), ``--trials``, ``--seed``."""
    from kvnotes.cli.errors import int_at_least

    ap.add_argument("--lengths", type=int_at_least("--lengths", 1), nargs="+", default=lengths,
                    help="prompt lengths L in tokens" + (" (default: the device's list)" if lengths is None else ""))
    ap.add_argument("--prefix", type=int_at_least("--prefix", 1), default=32, help="live prefix tokens before the chunk")
    ap.add_argument("--suffix", type=int_at_least("--suffix", 1), default=64,
                    help="live suffix tokens after the chunk (state update + question)")
    ap.add_argument("--seam", type=int_at_least("--seam", 0), default=4, help="chunk tokens recomputed after the splice")
    ap.add_argument("--warmup", type=int_at_least("--warmup", 0), default=warmup, help="untimed runs first")
    ap.add_argument("--trials", type=int_at_least("--trials", 1), default=5, help="timed trials (median reported)")
    ap.add_argument("--seed", type=int_at_least("--seed", 0), default=0, help="seed of the random token ids")


def main() -> None:
    """Run the benchmark (see the module docstring).

    Raises:
        KvnotesError: a bad flag (an unknown model, a length not longer than prefix + suffix, a count
            below its least value, a malformed grid, ``--image`` on CUDA) before any model loads.
    """
    from kvnotes.cli.errors import conf_name
    from kvnotes.errors import KvnotesError

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__.split("\n")[0])
    add_machine_flags(ap)      # --device cuda: a random Qwen3-8B-shaped bf16 model on CUDA
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"),
                    help="zoo config for the CPU path")
    add_layout_flags(ap, lengths=None, warmup=1)
    ap.add_argument("--no-graphs", action="store_true", help="GPU: run the composed forward eagerly")
    ap.add_argument("--image", action="store_true", help="image rows: re-encoding the image vs its precompiled chunk "
                    "(random-weight shrunk VLM, CPU)")
    ap.add_argument("--vlm", default="qwen3-vl-2b", type=conf_name("model", "--vlm"),
                    help="--image: zoo entry of the M-RoPE VLM")
    ap.add_argument("--grids", nargs="+", default=None, type=grid_arg, help="--image: image grids TxHxW in patches")
    args = ap.parse_args()
    args.gpu = args.device == "cuda"
    if args.image and args.gpu:
        raise KvnotesError("--image runs on CPU (a shrunk random VLM): leave out --device cuda")
    lengths = args.lengths or ([2048, 4096, 8192, 16384, 32768] if args.gpu else [1024, 2048, 4096, 8192])
    if not args.image and min(lengths) <= args.prefix + args.suffix:
        raise KvnotesError(f"--lengths: each length must exceed --prefix + --suffix ({args.prefix + args.suffix}) "
                           f"to leave a chunk, got {min(lengths)}")
    torch.set_num_threads(args.threads)
    if args.image:
        image_main(args)
        return
    if args.gpu:
        model, name = gpu_model(), "random Qwen3-8B-shaped (bf16)"
        device = torch.cuda.get_device_name()
    else:
        model, name = embedded_model(args.model), args.model
        device = f"cpu ({platform.processor() or platform.machine()}, {args.threads} thread(s))"
    # the serving path's KV pool: allocated once for the longest prompt, reused by every call
    runner = kvcompose.ComposeRunner(model, max(lengths), graphs=args.gpu and not args.no_graphs)
    header = (f"# {' '.join(['python', *sys.argv])}\n# model: {name}; device: {device}; torch {torch.__version__}; "
              f"transformers {transformers.__version__}; attn {model.config._attn_implementation}; "
              f"dtype {next(model.parameters()).dtype}\n# prefix {args.prefix} + chunk + suffix {args.suffix} tokens; "
              f"seam {args.seam}; warm-up {args.warmup}; {args.trials} trials; medians in ms\n"
              f"# composed = ComposeRunner: rotate+splice into a reused KV pool of {max(lengths)} slots (allocated "
              f"once), one forward "
              f"({'CUDA graph, captured in the first call: first_call_ms' if runner.graphs else 'eager'}); "
              f"one_pass = compose_one_pass (eager, new cache); compose() = two-forward library path")
    print(header, flush=True)
    print(f"{'tokens':>7} {'full_ms':>9} {'composed_ms':>11} {'ratio':>6} {'one_pass_ms':>11} {'compose()_ms':>12} "
          f"{'precompile_ms':>13} {'first_call_ms':>13} {'KL(full||comp)':>14} top1", flush=True)
    rates_rows = 8192 if args.gpu else 1024
    rates = [machine_rates(model, rows=rates_rows)]
    out = []
    for L in lengths:
        r = bench_length(model, L, args.prefix, args.suffix, args.seam, args.warmup, args.trials, args.gpu, args.seed,
                         runner)
        out.append(r)
        print(f"{L:>7} {r['full']['median_ms']:>9.1f} {r['composed']['median_ms']:>11.1f} "
              f"{r['ratio_full_over_composed']:>6.1f} {r['one_pass']['median_ms']:>11.1f} "
              f"{r['compose_api']['median_ms']:>12.1f} {r['precompile']['median_ms']:>13.1f} "
              f"{r['first_call_ms']:>13.0f} {r['kl_full_composed']:>14.4f} "
              f"{'agree' if r['top1_agree'] else 'differ'}", flush=True)
    rates.append(machine_rates(model, rows=rates_rows))
    best = (max(r[0] for r in rates), max(r[1] for r in rates))
    print(f"# floors at the best rates measured before and after the timings: {best[0] / 1e12:.3f} TFLOP/s (GEMM), "
          f"{best[1] / 1e9:.1f} GB/s (weight read); before {rates[0][0] / 1e12:.3f} / {rates[0][1] / 1e9:.1f}, after "
          f"{rates[1][0] / 1e12:.3f} / {rates[1][1] / 1e9:.1f}\n"
          f"# full floor: the prefill's FLOPs; composed floor: weights + the chunk's K/V read once + its keys rotated")
    print(f"{'tokens':>7} {'full_ms':>9} {'floor':>8} {'x_floor':>7} {'composed_ms':>11} {'floor':>7} {'x_floor':>7} "
          f"{'floor_ratio':>11}")
    for r in out:
        r.update(floors_ms(model, best, r["length"], args.prefix, args.suffix, args.seam))
        full_ms, comp_ms = r["full"]["median_ms"], r["composed"]["median_ms"]
        print(f"{r['length']:>7} {full_ms:>9.1f} {r['full_floor_ms']:>8.1f} {full_ms / r['full_floor_ms']:>6.1f}x "
              f"{comp_ms:>11.1f} {r['composed_floor_ms']:>7.2f} {comp_ms / r['composed_floor_ms']:>6.1f}x "
              f"{r['full_floor_ms'] / r['composed_floor_ms']:>10.0f}x")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"header": header, "args": vars(args), "rows": out,
                                               "rates_before_after": rates}, indent=1))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
