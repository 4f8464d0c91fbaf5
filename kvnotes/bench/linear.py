#!/usr/bin/env python
"""PyTorch's default fp32 linear kernel against the prepacked oneDNN one (``model.cpu_linear``), on the CPU.

    kvnotes bench linear [--rows 1 21 42 64 112 224] [--threads 2]     # embedded SmolLM2-135M

Two copies of the model are loaded, one with ``cpu_linear=torch`` and one with ``cpu_linear=onednn``
(:mod:`kvnotes.models.cpu_linear`). For each row count ``R`` the script times both kernels in this one
run, one right after the other (``torch.utils.benchmark``, blocked autorange, median):

- ``gemm``: one ``[R, hidden] x [hidden, intermediate]`` product (the MLP's up projection);
- ``decode``: one forward of ``R`` rows fed on a batch-1 prefix of a default-suite prompt (the
  shape of a batched decision forward: ``R`` variants, one token each, every position's logits);
- ``prefill`` (``R`` = 1 and 2): the prompt prefilled as a batch of ``R`` copies (``R x T`` rows).

It prints each time and the ratio default / oneDNN, and checks that the two models' logits agree
within 1e-4. ``--json PATH`` writes the numbers.
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


#: Largest |logit| difference between the two kernels' forwards (fp32 summation order).
AGREE_TOL = 1e-4


def main() -> None:
    """Run the benchmark (see the module docstring).

    Raises:
        KvnotesError: a bad flag (an unknown model, rows below 1, a non-positive run time, a device
            other than the CPU or a torch build without oneDNN), a model without packable layers.
        SystemExit: 1 when the two kernels disagree beyond the tolerance.
    """
    from kvnotes.cli.errors import conf_name, float_at_least, int_at_least
    from kvnotes.errors import KvnotesError

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, prog=sys.argv[0], description=__doc__)
    add_machine_flags(ap)
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"), help="conf/model entry")
    ap.add_argument("--rows", type=int_at_least("--rows", 1), nargs="+", default=[1, 2, 21, 42, 64, 112, 224], help='row counts R of the products and decode forwards')
    ap.add_argument("--min-run-time", type=float_at_least("--min-run-time", 0.0, strict=True), default=1.0,
                    help="seconds per blocked-autorange measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import torch.utils.benchmark as tb
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kvnotes.harness.pairs import prepare_for_probe
    from kvnotes.kv import cache as kvcache
    from kvnotes.models import cpu_linear
    from kvnotes.models.loading import load_model

    if args.device != "cpu" or not cpu_linear.available():
        raise KvnotesError("bench linear: the oneDNN kernel runs on the CPU only (--device cpu, a torch "
                           "build with oneDNN)")
    from kvnotes.harness.registry import register_schemas

    register_schemas(names={"screen"})
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={args.model}", "probe=screen", "scenario=default", "device=cpu"])
    arms = {k: load_model(OmegaConf.merge(cfg.model, {"cpu_linear": k}), "cpu") for k in ("torch", "onednn")}
    if not cpu_linear.packed_layers(arms["onednn"].model):
        raise KvnotesError(f"bench linear: model '{args.model}' has no packable fp32 linear layers")
    pair = prepare_for_probe(arms["torch"].tokenizer, "field", cfg.scenario, cfg.model).pairs[0]
    d = pair.decision
    prompt = pair.old.ids[:d]
    text = arms["torch"].model.config.get_text_config()
    caches = {k: kvcache.prefill(b.model, prompt) for k, b in arms.items()}

    def median(fn) -> float:
        return tb.Timer("fn()", globals={"fn": fn}, num_threads=args.threads).blocked_autorange(
            min_run_time=args.min_run_time).median

    rows_out, worst = [], 0.0
    print(f"bench linear: {args.model}, {args.threads} thread(s), {platform.processor() or platform.machine()}; "
          f"prompt of {d} tokens; load average {os.getloadavg()[0]:.1f}")
    print(f"{'rows':>5} {'what':>8} {'default ms':>11} {'oneDNN ms':>10} {'ratio':>6}")
    with torch.no_grad():
        w = torch.randn(text.intermediate_size, text.hidden_size)
        packed = cpu_linear.pack_weight(w)
        for R in args.rows:
            x = torch.randn(R, text.hidden_size)
            ids = torch.full((R, 1), int(pair.old.ids[d]))
            pos = torch.full((R, 1), d)
            calls: dict[str, dict] = {
                "gemm": {"torch": lambda: torch.nn.functional.linear(x, w), "onednn": lambda: cpu_linear.packed_linear(x, packed)},
                "decode": {k: (lambda b=b, c=caches[k]: b.model(input_ids=ids, position_ids=pos, use_cache=False,
                                                                past_key_values=kvcache.expand_cache(c, b.model.config, R)).logits)
                           for k, b in arms.items()},
            }
            if R in (1, 2):
                calls["prefill"] = {k: (lambda b=b: kvcache.prefill(b.model, prompt[None].expand(R, -1)))
                                    for k, b in arms.items()}
            out = calls["decode"]["torch"]() - calls["decode"]["onednn"]()
            worst = max(worst, float(out.abs().max()))
            for what, fns in calls.items():
                t = {k: median(f) for k, f in fns.items()}
                row = {"rows": R, "what": what, "torch_ms": t["torch"] * 1e3, "onednn_ms": t["onednn"] * 1e3,
                       "ratio": t["torch"] / t["onednn"]}
                rows_out.append(row)
                print(f"{R:5d} {what:>8} {row['torch_ms']:11.2f} {row['onednn_ms']:10.2f} {row['ratio']:6.2f}", flush=True)
    print(f"largest |logit difference| of the decode forwards: {worst:.1e} (tolerance {AGREE_TOL:g}); "
          f"load average {os.getloadavg()[0]:.1f}")
    if worst > AGREE_TOL:
        raise SystemExit("kvnotes bench linear: the two kernels disagree beyond the tolerance")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "threads": args.threads, "prompt_tokens": d,
                                               "rows": rows_out, "max_abs_logit_diff": worst}, indent=2))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
