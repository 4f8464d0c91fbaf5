#!/usr/bin/env python
"""Serving edits on vLLM: automatic prefix caching for in-place rewrite, erratum, hoist and cold
prefill, with every answer checked against the harness (paper "Models Take Notes at Prefill",
systems claim). Runs in the serving environment (``bash scripts/install.sh --serving``)::

    .venv-serving/bin/kvnotes serve-bench                  # the embedded SmolLM2-135M, CPU
    .venv-serving/bin/kvnotes serve-bench --sessions 2 --turns 2 --doc-tokens 256 \
        --positions middle --rates 1 --name short                    # a short trace

Stages: (1) build the traces from the scenario files (:mod:`kvnotes.serving`); (2) the harness's
full-prefill reference of every distinct prompt with transformers (same weights); (3) one in-process
vLLM engine (``AsyncLLM``, prefix caching on, fp32, eager); (4) the engine-vs-harness cross-check of
next-token log-probs (whole vocabulary) on a few prompts; (5) for every rate, position and arm: reset
the prefix cache, check it is cold, serve the trace under Poisson arrivals (bounded in count and
time) with one decision token per request, and read vLLM's counters (``num_cached_tokens`` per
request and the engine's ``vllm:prefix_cache_hits/queries``). Writes
``runs/serving/<model>/<name>/record.json`` and its figures. On a GPU machine the same command runs
on ``pip install vllm`` (``--device-note`` is only recorded).

Any failure to set up (vLLM missing, engine not starting, bad arguments) is one line
``kvnotes: error: ...`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from kvnotes import CONF_DIR
from kvnotes.cli.helptext import PlainHelpFormatter


#: Largest |log p_vLLM - log p_harness| (nats) accepted for the candidates' first tokens: both run
#: fp32 on the same weights; only the attention kernels and reduction orders differ (vLLM's CPU
#: paged attention over cached blocks vs transformers' SDPA over the whole prompt), which moves
#: log-probs by fp32 rounding (~1e-5..1e-4 nats through 30 layers). 0.01 nats is far above that
#: and 100x below the 1-nat decision margin of the flip rule, so a real mismatch (wrong positions,
#: a stale block, another dtype) fails it while rounding never does.
CANDIDATE_LOGPROB_TOL = 1e-2


def parse_args(argv=None) -> argparse.Namespace:
    """The command's flags, each checked as it is parsed (:mod:`kvnotes.cli.errors`).

    Raises:
        KvnotesError: a count below its least value (sessions, turns, tokens, threads, ...), a
            non-positive time limit.
        SystemExit: 2 on an unknown flag (argparse).
    """
    from kvnotes.cli.errors import float_at_least, int_at_least

    ap = argparse.ArgumentParser(formatter_class=PlainHelpFormatter, description=__doc__)
    ap.add_argument("--model", default="smollm2-135m", help="conf/model/<name>.yaml (default: the embedded model)")
    ap.add_argument("--scenarios", default="scenarios/suites", help="scenario files or directories")
    ap.add_argument("--families", default="recall,lookup", help="comma list; the families a 135M model owns")
    ap.add_argument("--sessions", type=int_at_least("--sessions", 1), default=2, help="sessions (scenario instances) per trace")
    ap.add_argument("--turns", type=int_at_least("--turns", 1), default=3, help="turns per session; the field changes every turn")
    ap.add_argument("--doc-tokens", type=int_at_least("--doc-tokens", 1), default=512, help="tokens of shared document around the field")
    ap.add_argument("--positions", default="early,middle,late", help='comma list of where the field sits in the shared document: early, middle, late')
    ap.add_argument("--arms", default="in_place,erratum,hoist,cold",
                    help="comma list of update strategies: in_place (rewrite the field), erratum (append a correction), "
                         "hoist, cold (in_place by a full prefill); through kvnotes' KV connector: composed (precompiled "
                         "chunks), composed_cold (the same prompts, full prefill), edited (the field's K/V refreshed "
                         "in the stale prompt; at the first of --positions)")
    ap.add_argument("--chunk-tokens", type=int_at_least("--chunk-tokens", 8), default=512,
                    help="composed arm: tokens per precompiled chunk of the shared document")
    ap.add_argument("--store", default="", help="the KV connector's chunk store directory (default: a temporary "
                                                "directory, removed at the end)")
    ap.add_argument("--rates", default="0.5,2", help="Poisson arrival rates, requests/s")
    ap.add_argument("--time-limit", type=float_at_least("--time-limit", 0.0, strict=True), default=45.0,
                    help="seconds per run: requests due later are not sent (counted)")
    ap.add_argument("--reference", default="reuse", choices=["reuse", "full"],
                    help="harness references: continue a session's earlier prompt from the common prefix (reuse) "
                         "or prefill every prompt (full); the cross-check prompts are always full prefills")
    ap.add_argument("--cross-check", type=int_at_least("--cross-check", 1), default=4, help="prompts in the engine-vs-harness cross-check")
    ap.add_argument("--max-model-len", type=int_at_least("--max-model-len", 1), default=4096, help="the engine's context limit in tokens (vLLM max_model_len)")
    ap.add_argument("--max-num-seqs", type=int_at_least("--max-num-seqs", 1), default=4, help='requests the engine batches at once (vLLM max_num_seqs)')
    ap.add_argument("--block-size", type=int_at_least("--block-size", 1), default=None, help="KV block size (default: the engine's; 128 on CPU)")
    ap.add_argument("--threads", type=int_at_least("--threads", 1), default=1, help="OpenMP threads of the engine and of torch")
    ap.add_argument("--kv-cache-gib", type=int_at_least("--kv-cache-gib", 1), default=1, help="VLLM_CPU_KVCACHE_SPACE (CPU backend)")
    ap.add_argument("--seed", type=int_at_least("--seed", 0), default=0, help='seed of the traces (sessions, values, arrival times) and of the engine')
    ap.add_argument("--name", default="default", help="record directory name under runs/serving/<model>/")
    ap.add_argument("--out-root", default="runs/serving", help='records go to OUT_ROOT/<model>/<name>/record.json')
    ap.add_argument("--force", action="store_true", help="re-run when the record is complete")
    ap.add_argument("--no-plot", action="store_true", help='write the record only, no figures')
    ap.add_argument("--verbose", action="store_true", help="keep vLLM's own INFO logging")
    ap.add_argument("--device-note", default="", help="free text recorded with the host (e.g. GPU model)")
    return ap.parse_args(argv)


def fail(msg: str) -> None:
    print(f"kvnotes: error: {msg}", file=sys.stderr)
    sys.exit(2)


def configure_env(args) -> None:
    """Thread and memory settings for the vLLM CPU backend, set before vLLM is imported: no core
    binding (the machine is shared; ``OMP_NUM_THREADS`` threads), a small KV-cache space, quiet logs."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def harness_stage(args, model_cfg, store_dir: str | None):
    """Trace and full-prefill references (transformers), and the connector arms' store entries
    (:mod:`kvnotes.serving.arms`); the HF model is freed before the engine starts."""
    import torch

    from kvnotes.errors import KvnotesError
    from kvnotes.models.loading import load_model
    from kvnotes.serving import ARMS, build_trace
    from kvnotes.serving.arms import CONNECTOR_ARMS, composed_requests, edited_requests
    from kvnotes.serving.store import ChunkStore
    from kvnotes.scenarios import load_suite

    arms = split(args.arms)
    unknown = [a for a in arms if a not in ARMS + CONNECTOR_ARMS]
    if unknown or not arms:
        raise KvnotesError(f"unknown arm '{unknown[0] if unknown else ''}' (known: {', '.join(ARMS + CONNECTOR_ARMS)})")
    torch.set_num_threads(args.threads)
    bundle = load_model(model_cfg, "cpu")
    scenarios = load_suite([args.scenarios], families=split(args.families) or None)
    from kvnotes.harness.pairs import template_kwargs

    kwargs = template_kwargs(model_cfg)
    classic = [a for a in arms if a in ARMS]
    requests, excluded = build_trace(bundle.tokenizer, scenarios, args.sessions, args.turns, args.doc_tokens,
                                     split(args.positions), classic, args.seed, template_kwargs=kwargs) if classic else ([], [])
    registered = {}
    if store_dir is not None:
        store = ChunkStore(store_dir)
        if "composed" in arms or "composed_cold" in arms:
            got, exc, registered["composed"] = composed_requests(
                bundle.model, bundle.tokenizer, scenarios, store, args.sessions, args.turns, args.doc_tokens,
                args.chunk_tokens, args.seed, kwargs, cold="composed_cold" in arms)
            requests += [r for r in got if r.arm in arms]
            excluded += exc
        if "edited" in arms:
            got, exc, registered["edited"] = edited_requests(
                bundle.model, bundle.tokenizer, scenarios, store, args.sessions, args.turns, args.doc_tokens,
                split(args.positions)[0], args.seed, kwargs)
            requests += got
            excluded += exc
    if not requests:
        raise KvnotesError("no request could be built (every prompt was excluded)")
    first = requests[0].session
    checks = [r for r in requests if r.session == first and r.salt is None and r.arm != "cold"][: args.cross_check]
    from kvnotes.serving import reference_decisions

    t0 = time.perf_counter()
    keep = {r.key for r in checks} | {r.key for r in requests if r.plan is not None}
    ref, full = reference_decisions(bundle.model, requests, keep, progress=True, method=args.reference)
    ref_s = time.perf_counter() - t0
    info = dict(bundle.info)
    if model_cfg.get("embedded"):
        from kvnotes.models.loading import materialise_embedded

        source = str(materialise_embedded(model_cfg.embedded)[0])
    else:
        source = info["path"]
    del bundle
    gc.collect()
    return requests, excluded, scenarios, checks, ref, full, info, source, ref_s, registered


def start_engine(args, source: str, store_dir: str | None = None):
    """An in-process ``AsyncLLM`` (prefix caching on, fp32, eager; with ``store_dir``, kvnotes' KV
    connector over that chunk store) or :class:`KvnotesError`."""
    from kvnotes.errors import KvnotesError

    try:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        raise KvnotesError(f"vLLM is not importable here ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                           f"install the serving environment with `bash scripts/install.sh --serving` and run "
                           f"this script with .venv-serving/bin/python") from None
    extra: dict = {"block_size": args.block_size} if args.block_size else {}
    if store_dir is not None:
        from vllm.config import KVTransferConfig

        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvnotesConnector", kv_role="kv_both", kv_connector_module_path="kvnotes.serving.connector",
            kv_connector_extra_config={"store": store_dir, "preload": True})
    eargs = AsyncEngineArgs(model=source, tokenizer=source, dtype="float32", max_model_len=args.max_model_len,
                            max_num_seqs=args.max_num_seqs, enable_prefix_caching=True, enforce_eager=True,
                            max_logprobs=-1, seed=args.seed, disable_log_stats=False, **extra)
    try:
        return AsyncLLM.from_engine_args(eargs)
    except Exception as exc:  # the engine raises many types (RuntimeError, ValueError, OSError, ...)
        msg = str(exc).strip().splitlines()
        raise KvnotesError(f"the vLLM engine could not start ({type(exc).__name__}: "
                           f"{msg[-1] if msg else 'no message'}); rerun with --verbose for vLLM's log") from None


def prefix_counters() -> dict | None:
    """vLLM's own prefix-cache counters (tokens queried / hit) from its in-process Prometheus registry."""
    try:
        from vllm.v1.metrics.reader import Counter, get_metrics_snapshot
    except ImportError:
        return None
    out = {"queries": 0.0, "hits": 0.0}
    for m in get_metrics_snapshot():
        if isinstance(m, Counter) and m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
            out["queries" if m.name.endswith("queries") else "hits"] += m.value
    return out


async def serve_one(engine, ids, params, salt: str | None = None):
    """Serve one prompt; returns (final output, seconds to the first output, send time)."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(ids))
    if salt:
        prompt["cache_salt"] = salt
    t0 = time.perf_counter()
    first, final = None, None
    async for out in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
        if first is None:
            first = time.perf_counter() - t0
        final = out
    return final, first, t0


def sampling(candidates: dict | None = None, full: bool = False, plan: dict | None = None):
    """One greedy decision token with the candidates' log-probs (``full``: the whole vocabulary's, not
    detokenised); ``plan``: kvnotes' connector plan as the request's ``kv_transfer_params``."""
    from vllm import SamplingParams

    extra = {"extra_args": {"kv_transfer_params": plan}} if plan else {}
    if full:
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=-1, detokenize=False, **extra)
    return SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=sorted(set(candidates.values())), **extra)


def provenance(output, r, full: dict | None) -> dict:
    """The path that served a request (kvnotes' connector label, :data:`kvnotes.serving.store.PATHS`;
    None without the connector), tokens it loaded, and for a request with a plan the first-token
    KL(harness full prefill || served) in nats (its full prefill is in ``full``)."""
    from kvnotes.serving.trace import first_token_kl

    kv = output.kv_transfer_params or {}
    row = {"path": kv.get("kvnotes_path"), "loaded_tokens": kv.get("kvnotes_loaded"), "refused": kv.get("kvnotes_refused")}
    if r.plan is not None and full is not None and r.key in full:
        served = {t: float(v.logprob) for t, v in output.outputs[0].logprobs[0].items()}
        row["kl_first_token"] = first_token_kl(full[r.key], served)
    return row


def logprob_of(output, token: int) -> float | None:
    lp = output.outputs[0].logprobs
    if not lp or token not in lp[0]:
        return None
    return float(lp[0][token].logprob)


async def cross_check(engine, checks, full_ref) -> dict:
    """vLLM's whole-vocabulary next-token log-probs vs the harness's full prefill, prompt by prompt,
    served in trace order on a reset cache (so later turns are served from cached blocks)."""
    import numpy as np

    assert await engine.reset_prefix_cache()
    rows = []
    for r in checks:
        out, _, _ = await serve_one(engine, r.ids, sampling(full=True))
        lp = out.outputs[0].logprobs[0]
        ref = full_ref[r.key].numpy()
        served = np.full_like(ref, np.nan)
        for tok, v in lp.items():
            served[tok] = v.logprob
        cand = [abs(served[t] - ref[t]) for t in r.candidates.values()]
        finite = np.isfinite(served) & np.isfinite(ref)
        rows.append({"arm": r.arm, "position": r.position, "turn": r.turn, "n_prompt": len(r.ids),
                     "n_cached": out.num_cached_tokens, "max_abs_diff_candidates": float(max(cand)),
                     "max_abs_diff_vocab": float(np.abs(served[finite] - ref[finite]).max()),
                     "n_vocab_compared": int(finite.sum()),
                     "top1_equal": int(np.nanargmax(served)) == int(ref.argmax())})
    worst = max(r["max_abs_diff_candidates"] for r in rows)
    return {"rows": rows, "tolerance_nats": CANDIDATE_LOGPROB_TOL, "max_abs_diff_candidates": worst,
            "max_abs_diff_vocab": max(r["max_abs_diff_vocab"] for r in rows),
            "all_top1_equal": all(r["top1_equal"] for r in rows), "within_tolerance": worst <= CANDIDATE_LOGPROB_TOL}


async def run_trace(engine, requests, rate: float, time_limit: float, seed: int, ref: dict,
                    full: dict | None = None) -> tuple[list[dict], dict]:
    """Serve one arm's trace under Poisson arrivals on a freshly reset prefix cache.

    A session's turn is sent at its arrival time or when its previous turn has been answered,
    whichever is later; requests due after ``time_limit`` seconds are not sent.

    Returns:
        (per-request rows, run info: reset result, counters before/after, cached tokens of the first
        request from vLLM's own prefix cache: ``num_cached_tokens`` less what the connector loaded).
    """
    import numpy as np

    reset = await engine.reset_prefix_cache()
    before = prefix_counters()
    rng = np.random.default_rng([seed, int(rate * 1000)])
    arrivals = np.cumsum(np.concatenate([[0.0], rng.exponential(1.0 / rate, len(requests) - 1)]))
    done: dict[tuple, asyncio.Event] = {(r.session, r.turn): asyncio.Event() for r in requests}
    t_start = time.perf_counter()

    async def one(r, due):
        await asyncio.sleep(max(0.0, t_start + due - time.perf_counter()))
        if r.turn > 0 and (r.session, r.turn - 1) in done:
            await done[(r.session, r.turn - 1)].wait()
        row = {"arm": r.arm, "position": r.position, "session": r.session, "scenario": r.scenario,
               "family": r.family, "turn": r.turn, "value": r.value, "expected": r.expected,
               "n_prompt": len(r.ids), "field_token": r.field_token, "rate": rate, "due_s": float(due)}
        if time.perf_counter() - t_start > time_limit:
            done[(r.session, r.turn)].set()
            return row | {"sent": False}
        salt = r.salt or (uuid.uuid4().hex if r.arm == "cold" else None)
        whole = full is not None and r.key in full                     # whole-vocabulary log-probs: the KL
        out, ttft, t0 = await serve_one(engine, r.ids, sampling(r.candidates, whole, r.plan), salt)
        done[(r.session, r.turn)].set()
        served = out.outputs[0].token_ids[0]
        h = ref[r.ids]
        lp = {o: logprob_of(out, t) for o, t in r.candidates.items()}
        engine_ttft = getattr(out.metrics, "first_token_latency", None) if out.metrics else None
        return row | {
            "sent": True, "send_s": t0 - t_start, "ttft_s": ttft, "finish_s": time.perf_counter() - t_start,
            "engine_first_token_latency_s": engine_ttft, "n_cached": out.num_cached_tokens,
            "served_token": served, "harness_token": h["top1"], "expected_token": r.expected_token,
            "owned": h["top1"] == r.expected_token, "served_correct": served == r.expected_token,
            "agree": served == h["top1"], "served_cand_logprobs": lp, "harness_cand_logprobs": h["cand_logprobs"],
            "max_abs_diff_candidates": max(abs(lp[o] - h["cand_logprobs"][o]) for o in lp if lp[o] is not None),
        } | provenance(out, r, full)

    t0 = time.perf_counter()
    rows = await asyncio.gather(*(one(r, due) for r, due in zip(requests, arrivals)))
    wall = time.perf_counter() - t0
    after = prefix_counters()
    first = min((r for r in rows if r["sent"]), key=lambda r: r["send_s"], default=None)
    info = {"reset_ok": bool(reset), "counters_before": before, "counters_after": after,
            "first_request_cached_tokens": first["n_cached"] - (first.get("loaded_tokens") or 0) if first else None,
            "wall_s": wall}
    if before and after:
        q, h = after["queries"] - before["queries"], after["hits"] - before["hits"]
        info["engine_hit_rate"] = h / q if q else None
        info["engine_queries"], info["engine_hits"] = q, h
    return rows, info


async def bench(args, requests, checks, ref, full, source, store_dir: str | None = None) -> dict:
    """Engine stages: start, warm up (a plain request, then one planned request per connector arm,
    whose TTFT is recorded: the first use of a code path), cross-check, then every (rate, position,
    arm) run, each on a reset prefix cache."""
    engine = start_engine(args, source, store_dir)
    try:
        timing = {}
        t0 = time.perf_counter()
        warm = [r for r in requests if r.salt is None][0] if any(r.salt is None for r in requests) else requests[0]
        await serve_one(engine, warm.ids, sampling(warm.candidates))
        timing["warmup_s"] = time.perf_counter() - t0
        for arm in dict.fromkeys(r.arm for r in requests if r.plan):   # the connector's path warmed too
            first = next(r for r in requests if r.arm == arm and r.plan)
            _, ttft, _ = await serve_one(engine, first.ids, sampling(first.candidates, plan=first.plan), first.salt)
            timing[f"warmup_{arm}_ttft_s"] = ttft
        t0 = time.perf_counter()
        check = await cross_check(engine, checks, full)
        timing["cross_check_s"] = time.perf_counter() - t0
        block = engine.vllm_config.cache_config.block_size
        rows, runs = [], []
        for rate in [float(x) for x in split(args.rates)]:
            for pos in [*split(args.positions), "composed"]:
                for arm in split(args.arms):
                    trace = [r for r in requests if r.arm == arm and r.position == pos]
                    if not trace:
                        continue
                    got, info = await run_trace(engine, trace, rate, args.time_limit, args.seed, ref, full)
                    from kvnotes.serving import summarize_run

                    summary = summarize_run(got, info["wall_s"])
                    runs.append({"arm": arm, "position": pos, "rate": rate, **info, **summary})
                    rows.extend(got)
                    print(f"kvnotes: serve {arm:8s} {pos:6s} rate {rate:g}/s: hit {summary['hit_rate']:.3f} "
                          f"(engine {_num(info.get('engine_hit_rate'))}), ttft p50 "
                          f"{summary['ttft_p50_s']:.2f}s p90 {summary['ttft_p90_s']:.2f}s, "
                          f"owned {summary['n_owned']}/{summary['n_sent']}, "
                          f"agree {summary['agreement']['k']}/{summary['agreement']['n']}"
                          + (f", paths {summary['paths']}" if summary["paths"] else "")
                          + (f", KL max {summary['kl_first_token_max']:.3g}" if summary["kl_first_token_max"] is not None
                             else ""), flush=True)
        return {"rows": rows, "runs": runs, "cross_check": check, "timing": timing,
                "engine": {"block_size": block, "enforce_eager": True, "dtype": "float32",
                           "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                           "enable_prefix_caching": True, "cold_arm": "per-request unique cache_salt",
                           "kv_connector": "kvnotes.serving.connector.KvnotesConnector" if store_dir else None}}
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def main(argv=None) -> None:
    """Run the experiment (see the module docstring).

    Raises:
        KvnotesError: a bad flag (:func:`parse_args`), an ``--out-root`` or ``--store`` that cannot be
            written as a directory; before vLLM is imported or any model loads.
        SystemExit: 2 when vLLM is not installed, the model is unknown or a setting is refused.
    """
    import importlib.util

    from kvnotes.cli.errors import check_writable

    args = parse_args(argv)
    check_writable(args.out_root, "--out-root", directory=True)        # the record is written at the end
    if args.store:
        check_writable(args.store, "--store", directory=True)
    if importlib.util.find_spec("vllm") is None:
        fail("vLLM is not installed in this environment: install the serving environment with "
             "`bash scripts/install.sh --serving` and run this script with .venv-serving/bin/python")
    configure_env(args)
    from omegaconf import OmegaConf

    from kvnotes.errors import KvnotesError
    from kvnotes.records.store import RECORD_NAME, is_complete, new_record, write_atomic

    cfg_path = CONF_DIR / "model" / f"{args.model}.yaml"
    if not cfg_path.is_file():
        fail(f"unknown model '{args.model}' (no conf/model/{args.model}.yaml)")
    model_cfg = OmegaConf.load(cfg_path)
    out_dir = Path(args.out_root) / args.model / args.name
    if is_complete(out_dir / RECORD_NAME) and not args.force:
        print(f"kvnotes: {out_dir / RECORD_NAME} is complete; skipping (--force to re-run)")
        return
    t_all = time.perf_counter()
    try:
        if args.rates and any(float(x) <= 0 for x in split(args.rates)):
            raise KvnotesError(f"rates must be positive: {args.rates}")
        from kvnotes.serving.arms import CONNECTOR_ARMS

        with contextlib.ExitStack() as stack:
            store_dir = None
            if any(a in CONNECTOR_ARMS for a in split(args.arms)):
                store_dir = args.store or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvnotes-store-"))
            t0 = time.perf_counter()
            requests, excluded, scenarios, checks, ref, full, info, source, ref_s, registered = \
                harness_stage(args, model_cfg, store_dir)
            trace_s = time.perf_counter() - t0
            result = asyncio.run(bench(args, requests, checks, ref, full, source, store_dir))
    except KvnotesError as exc:
        fail(str(exc))
    except ValueError as exc:
        fail(f"bad argument: {exc}")
    import vllm

    from kvnotes.serving import aggregate

    record = new_record("serving", vars(args), {}, info, args.seed)
    record["presentation"] = "kvnotes.serving"                  # its table (kvnotes.records.presentation)
    record["packages"]["vllm"] = vllm.__version__
    record["host"]["note"] = args.device_note
    record["scenario"] = {"name": ",".join(split(args.families)), "n_scenarios": len(scenarios),
                          "families": sorted({s.family for s in scenarios}), "n_requests": len(requests)}
    record["result"] = {"rows": result["rows"], "runs": result["runs"], "cross_check": result["cross_check"],
                        "engine": result["engine"], "exclusions": excluded,
                        "aggregates": aggregate(result["runs"]), "registered": registered}
    record["timing"] = {"trace_and_reference_s": trace_s, "reference_s": ref_s, **result["timing"],
                        "total": time.perf_counter() - t_all}
    record["status"] = "complete"
    write_atomic(out_dir / RECORD_NAME, record)
    print(f"kvnotes: wrote {out_dir / RECORD_NAME}")
    if not args.no_plot:
        from kvnotes.plots import plot_record

        for path in plot_record(record, out_dir):
            print(f"kvnotes: wrote {path}")


if __name__ == "__main__":
    from kvnotes.cli.errors import guarded

    guarded(main)
