#!/usr/bin/env python
"""Which expected-flip pairs of some scenario files the model OWNS: a quick scan for prompt work.

A pair is owned when it flips under the ``owned`` rule of :func:`kvnotes.harness.readout.pair_status` (the
candidate decision differs, ``|s_new - s_old| >= min_effect`` nats, and each clean run's top-1 token
over the whole vocabulary is its expected candidate's first token; ``flips_owned`` of ``probe=screen``).
Prints, per scenario, owned / expected-flip pairs, and for every prompt whose top-1 is not its
candidate the top-1 token and the candidates' probabilities. One model load, one forward per
distinct prompt (full prompt, no cache surgery), so it is a screening aid, not a record.

    OMP_NUM_THREADS=1 kvnotes ownership-scan scenarios/suites/lookup scenarios/suites/language
    kvnotes ownership-scan scenarios/suites/lookup --n-instances 4 --seed 0 --quiet
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from kvnotes import CONF_DIR
from kvnotes.cli.helptext import PlainHelpFormatter


import torch
from omegaconf import OmegaConf

from kvnotes.models.loading import load_model
from kvnotes.harness.pairs import prepare_pairs
from kvnotes.harness.readout import clean_decisions, pair_status


@torch.no_grad()
def decision_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[vocab]`` (fp32) of the next token after the whole prompt ``ids`` ``[T]``."""
    logits = model(ids[None].to(model.device)).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def scan(bundle, paths: list[str], n_instances: int, seed: int, variant: str, min_effect: float,
         quiet: bool = False) -> dict[str, dict]:
    """Scan the scenario files/directories ``paths``; print and return per-scenario counts."""
    tok = bundle.tokenizer
    cfg = OmegaConf.create({"paths": paths, "families": None, "ids": None, "n_instances": n_instances,
                            "seed": seed, "variant": variant, "chat_template": True})
    pset = prepare_pairs(tok, cfg, template_kwargs=None)
    memo: dict[str, torch.Tensor] = {}

    def lp_of(prompt):
        if prompt.text not in memo:
            memo[prompt.text] = decision_logprobs(bundle.model, prompt.ids)
        return memo[prompt.text]

    out: dict[str, dict] = defaultdict(lambda: {"family": None, "expected": 0, "flip": 0, "owned": 0,
                                                "excluded": 0, "misses": []})
    for ex in pset.excluded:
        out[ex["scenario"]]["excluded"] += 1
        out[ex["scenario"]]["family"] = ex["family"]
    for pair in pset.pairs:
        sc = pair.spec.instance.scenario
        row = out[sc.id]
        row["family"] = sc.family
        if not pair.spec.expect_flip:
            continue
        row["expected"] += 1
        lo, ln = lp_of(pair.old), lp_of(pair.new)
        co, cn = pair.cand_old[0], pair.cand_new[0]
        st = pair_status(float(lo[cn] - lo[co]), float(ln[cn] - ln[co]), min_effect, "owned",
                         clean_decisions(torch.stack([lo, ln]), pair))
        row["flip"] += st["flips_relative"]
        row["owned"] += st["flips_owned"]
        for value, lp, c in ((pair.spec.old, lo, co), (pair.spec.new, ln, cn)):
            top = int(lp.argmax())
            if top != c:
                row["misses"].append(f"{pair.spec.instance.id} {value}: top1 {tok.convert_ids_to_tokens(top)!r} "
                                     f"p={lp[top].exp():.3f}; want {tok.convert_ids_to_tokens(c)!r} p={lp[c].exp():.4f}")
    fam: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for sid, r in sorted(out.items(), key=lambda kv: (kv[1]["family"], kv[0])):
        f = fam[r["family"]]
        f[0] += r["owned"]
        f[1] += r["flip"]
        f[2] += r["expected"]
        print(f"{r['family']:10s} {sid:22s} owned {r['owned']:2d}/{r['expected']:2d}  flip {r['flip']:2d}  "
              f"excluded {r['excluded']}")
        if not quiet:
            for m in sorted(set(r["misses"])):
                print("    " + m)
    for name, (o, fl, e) in fam.items():
        print(f"FAMILY {name}: owned {o}/{e} ({o / max(e, 1):.0%}), flipping {fl}/{e}")
    return dict(out)


def main() -> None:
    """Scan (see the module docstring).

    Raises:
        KvnotesError: an unknown model, fewer than one instance, a negative seed or margin, a variant
            no selected scenario has; ScenarioError: a missing path or an invalid scenario file. All
            before the model loads.
    """
    from kvnotes.cli import add_machine_flags
    from kvnotes.cli.errors import conf_name, float_at_least, int_at_least, one_of
    from kvnotes.errors import KvnotesError
    from kvnotes.scenarios import load_suite

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__)
    ap.add_argument("paths", nargs="+", help="scenario files or directories")
    ap.add_argument("--model", default="smollm2-135m", type=conf_name("model", "--model"), help="conf/model/<name>.yaml")
    ap.add_argument("--n-instances", type=int_at_least("--n-instances", 1), default=4, help='instances drawn per scenario')
    ap.add_argument("--seed", type=int_at_least("--seed", 0), default=0, help='instance generator seed')
    ap.add_argument("--variant", default="direct", type=one_of("--variant", ("direct", "cot")),
                    help="prompt variant of the scenarios: direct or cot")
    ap.add_argument("--min-effect", type=float_at_least("--min-effect", 0.0), default=1.0, help="flip margin in nats")
    ap.add_argument("--quiet", action="store_true", help="counts only, no per-prompt misses")
    add_machine_flags(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scenarios = load_suite(args.paths)           # every file checked before the model loads
    if not any(args.variant in sc.variants for sc in scenarios):
        known = sorted({v for sc in scenarios for v in sc.variants})
        raise KvnotesError(f"--variant: no selected scenario has variant '{args.variant}' (theirs: {', '.join(known)})")
    bundle = load_model(OmegaConf.load(CONF_DIR / "model" / f"{args.model}.yaml"), args.device)
    counts = scan(bundle, args.paths, args.n_instances, args.seed, args.variant, args.min_effect, args.quiet)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "scenarios": counts}, indent=1, default=str))


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
