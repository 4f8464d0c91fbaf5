"""The probe kit: the steps every probe and circuit shares, in one place.

- **Clean runs and the flip filter.** :func:`each_pair` prefills every token-aligned pair once and
  describes its clean decision under the run's flip rule (``docs/design.md``, "Flip rules"); a
  :class:`CleanRuns` store on the context (``kvnotes battery``) keeps them across the probes of one
  job, so each pair is prefilled once per job, not once per probe;
  :func:`flipping_pairs` keeps the flipping ones and counts the rest by reason;
  :func:`excluded_rows` gives the exclusion rows of a probe that reports on every pair.
- **Aggregation straight from rows.** :func:`summary` (mean/median with the interval that fits the
  number of clusters, :func:`kvnotes.harness.stats.summarize`), :func:`by_family` (``"all"`` and each
  family), :func:`summaries_by_family` (recovery with the share of flipped decisions),
  :func:`exclusions_by_family`, :func:`worst` (a check's largest deviation).
- Selection and held-out splits live in :mod:`kvnotes.harness.selection`; scoring in
  :mod:`kvnotes.harness.readout`; cache truncation in :mod:`kvnotes.kv.cache`; knockouts in
  :mod:`kvnotes.kv.knockout`; layer bands here (:func:`layer_bands`).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from kvnotes.kv import cache as kvcache

from kvnotes.kv import patch as kvpatch
from kvnotes.errors import KvnotesError, ModelFitError
from kvnotes.harness.constraints import Count, one_of
from kvnotes.harness.pairs import pair_row
from kvnotes.harness.readout import PairRun, run_pair, variant_scores
from kvnotes.kv.generate import answer_marker, unreached_label
from kvnotes.kv.generate import stop_tokens  # noqa: F401  (the screened pairs' end tokens, patched by tests)
from kvnotes.harness.selection import round_robin
from kvnotes.harness.selection import pair_rng, sample_pairs, split_instances, with_split  # noqa: F401  (re-exported)
from kvnotes.harness.stats import INCONCLUSIVE, SUPPORTED, disagreeing, proportion, summarize, verdict_of

T = TypeVar("T")


@dataclass
class ProbeConfig:
    """Keys every probe config has (``conf/probe/_base.yaml``). A probe module declares its own
    keys in a subclass named ``Config``; ``run.py`` merges the probe's YAML into it, so a misspelt or
    unknown key is an error and values are type-checked (``probes.typed_config``).

    Attributes:
        name: the probe name (output directory, record ``probe``).
        _target_: ``module.run`` of the probe: how the registry finds it.
        pairs: the pairs ``run.py`` prepares: ``field`` (old/new field value) or ``polarity``.
        progress: progress bars on stderr.
        n_boot: cluster-bootstrap replicates per aggregate.
    """

    name: str = "?"
    _target_: str = "?"
    pairs: Annotated[str, one_of("field", "polarity", "none")] = "field"
    progress: bool = True
    n_boot: Count = 2000

    def check_run(self, run) -> None:
        """This probe's checks against the run's settings, before any model loads
        (:func:`kvnotes.harness.registry.check_run`): what its keys alone cannot say, e.g. that its
        selection / held-out split needs two instances per scenario
        (:func:`kvnotes.harness.constraints.require_instances`). None here; a probe overrides it.

        Args:
            run: the typed run config (:class:`kvnotes.harness.runconfig.RunSettings`: ``scenario``,
                ``model``, ``readout``, ...).

        Raises:
            KvnotesError: a run this probe cannot analyse, in one line naming the run key.
        """


@dataclass
class RandomControl:
    """Random control sets: ``n_draws`` draws per pair (a ``numpy.random.Generator`` seeded from
    the run seed and the pair id, :func:`kvnotes.harness.selection.pair_rng`)."""

    n_draws: Count = 5


#: Columns of an exclusion row.
EXCLUSION_COLUMNS = ("pair", "scenario", "family", "instance", "reason")


@dataclass
class FlippingSet:
    """Flipping pairs with their clean runs, and everything else counted by reason.

    Attributes:
        runs: :class:`PairRun` of each flipping pair (prefix caches + clean scores).
        rows: identifying columns + clean status of each flipping pair (same order as ``runs``).
        exclusions: reason -> count, over tokenisation exclusions and non-flipping pairs.
        excluded: one row per excluded pair, with its reason.
    """

    runs: list[PairRun] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    exclusions: dict[str, int] = field(default_factory=dict)
    excluded: list[dict] = field(default_factory=list)


@dataclass
class CleanRuns:
    """Clean runs (:func:`kvnotes.harness.readout.run_pair`) kept for the probes of one job, keyed by the
    pair object and the readout mode, with the prompts' prefix caches memoised by their tokens: the
    battery hands one store to every probe, so a pair is prefilled once per job however many
    probes screen it, and a prompt that several pairs share (the same instance and value in two
    pairs, a polarity pair's normal prompt and a field pair's) once for all of them. Probes treat
    the prefix caches as read-only (every forward on them extends a view), which is what makes
    sharing them exact: a probe gets the same numbers with or without the store (tests/harness/test_kit.py).

    Attributes:
        budget_bytes: bytes of prefix caches (:func:`kvnotes.kv.cache.variant_bytes`) the store keeps;
            beyond it, prompts are no longer memoised and runs are kept without caches (scores and
            decisions only; their caches are prefilled again when a later probe asks for them).
        used_bytes: bytes of caches held.
        prefilled: prompts prefilled here; shared: prompt prefills served from the memo;
        reused: clean runs served from the store.
    """

    budget_bytes: int = 8 << 30
    used_bytes: int = 0
    prefilled: int = 0
    shared: int = 0
    reused: int = 0
    _runs: dict = field(default_factory=dict, repr=False)
    _prompts: dict = field(default_factory=dict, repr=False)
    _held: set = field(default_factory=set, repr=False)

    def prefill(self, model, ids: torch.Tensor):
        """:func:`kvnotes.kv.cache.prefill` of ``ids`` (``[T]``), memoised by the tokens within the budget."""
        key = tuple(ids.tolist())
        cache = self._prompts.get(key)
        if cache is not None:
            self.shared += 1
            return cache
        self.prefilled += 1
        cache = kvcache.prefill(model, ids)
        size = kvcache.variant_bytes(cache)
        if self.used_bytes + size <= self.budget_bytes:
            self.used_bytes += size
            self._prompts[key] = cache
            self._held.add(id(cache))
        return cache

    def run(self, model, pair, mode: str = "first_token") -> PairRun:
        """The clean run of ``pair`` under readout ``mode``, with its prefix caches."""
        key = (id(pair), mode)
        kept = self._runs.get(key)
        if kept is not None and kept[0] is pair:
            self.reused += 1
            run = kept[1]
            return run if run.old_cache is not None else run.with_caches(model)
        run = run_pair(model, pair, mode, self.prefill)
        memoised = id(run.old_cache) in self._held and id(run.new_cache) in self._held
        self._runs[key] = (pair, run if memoised else run.released())
        return run


def per_prompt(fn: Callable[[torch.Tensor], T], size: int = 4) -> Callable[[torch.Tensor], T]:
    """``fn(ids)`` memoised on the prompt's tokens (``functools.lru_cache`` of the last ``size``
    prompts): pairs of one instance share prompts (an instance's value is the old side of one pair
    and the new side of another) and come one after another in suite order, so a per-prompt
    computation runs once per distinct prompt. ``fn`` must depend on the tokens only and its
    result must be treated as read-only."""
    cached = functools.lru_cache(maxsize=size)(lambda key: fn(torch.tensor(key, dtype=torch.long)))
    return lambda ids: cached(tuple(ids.tolist()))


def config_value(cfg, key: str, default=None):
    """``key`` of a probe config, whether a typed ``Config`` instance or a mapping (a YAML node not
    typed yet); ``default`` when it has none."""
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def progress(ctx) -> bool:
    """The probe config's ``progress`` flag (progress bars on stderr)."""
    return bool(config_value(ctx.cfg, "progress", True))


def units(ctx, items: Iterable[T], desc: str) -> Iterator[T]:
    """A probe's units in order (pairs, flipping runs, chunk plans, memory jobs, transcript
    instances), with the harness's progress bar on stderr (``desc``; off with the config's
    ``progress: false``): the one place a probe's loop shows progress."""
    seq = items if isinstance(items, Sized) else list(items)
    yield from tqdm(seq, desc=desc, disable=not progress(ctx))


def each_pair(ctx, pairs=None, desc: str = "clean runs") -> Iterator[tuple[PairRun, dict]]:
    """Prefill and screen every pair (``ctx.pairs.pairs`` by default), in suite order.

    Yields:
        (the pair's :class:`PairRun` with its prefix caches over ``[0, d)``, its row:
        :func:`kvnotes.harness.pairs.pair_row` columns and :func:`kvnotes.harness.readout.pair_status` columns under
        ``ctx.flip_rule`` / ``ctx.min_effect`` / ``ctx.readout``). Each pair is prefilled once here
        (or taken from ``ctx.clean_runs``, a :class:`CleanRuns` store, when the job has one); a probe
        that uses the caches right away never prefills it again.
    """
    store = getattr(ctx, "clean_runs", None)
    for pair in units(ctx, ctx.pairs.pairs if pairs is None else pairs, desc):
        with ctx.timer("clean_runs"):
            run = (store.run(ctx.bundle.model, pair, ctx.readout) if store is not None
                   else run_pair(ctx.bundle.model, pair, ctx.readout))
            status = run.status(ctx.min_effect, ctx.flip_rule)
        yield run, pair_row(pair) | status


def exclusion_counts(excluded: list[dict]) -> dict[str, int]:
    """reason -> count over exclusion rows."""
    return dict(Counter(r["reason"] for r in excluded))


def excluded_rows(tokenisation: list[dict], rows: list[dict]) -> list[dict]:
    """Exclusion rows (:data:`EXCLUSION_COLUMNS`) of a probe that measures every aligned pair and
    averages over the flipping ones: the tokenisation exclusions, then every row with
    ``flips == False`` (its reason from the flip rule)."""
    return [{k: r[k] for k in EXCLUSION_COLUMNS} for r in [*tokenisation, *(r for r in rows if not r["flips"])]]


def flipping_pairs(ctx, desc: str = "clean runs", keep_caches: bool = True,
                   process: Callable[[PairRun, dict], dict] | None = None) -> FlippingSet:
    """Run every aligned pair of ``ctx`` and keep those that flip under ``ctx.flip_rule``
    (``docs/design.md``, "Flip rules").

    Non-flipping pairs are excluded with reason ``no_decision_change``, ``small_effect`` or
    ``not_owned`` (flips between the candidates that are not the model's top-1 answers); pairs
    excluded at tokenisation keep their reason.

    Args:
        keep_caches: keep the prefix caches of flipping pairs in ``runs`` (else only scores).
        process: ``(run with caches, row) -> extra columns``, called on each flipping pair right
            after its clean run, so a probe that needs no other pair first uses the caches without
            prefilling the pair a second time; the row in ``rows`` is ``row | process(...)``.
    """
    out = FlippingSet(excluded=list(ctx.pairs.excluded))
    for run, row in each_pair(ctx, desc=desc):
        if row["flips"]:
            if process is not None:
                row = row | process(run, row)
            out.runs.append(run if keep_caches else run.released())
            out.rows.append(row)
        else:
            out.excluded.append(row)
    out.exclusions = exclusion_counts(out.excluded)
    return out


def require_first_token(ctx) -> None:
    """Circuit probes read the first-token logit difference (docs/design.md) from the engine's
    decision-position log-probs.

    Raises:
        KvnotesError: ``readout`` is not ``first_token``.
    """
    if ctx.readout != "first_token":
        raise KvnotesError(f"circuit probes use the first-token readout; got readout={ctx.readout}")


@torch.no_grad()
def single_position_scores(model, run: PairRun, mode: str = "first_token",
                           budget_bytes: int = kvcache.DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """The single-position map: scores of patching each downstream position ``p`` in ``[b, d)``
    alone, every layer, from the new run's cache into the old run's, in one batched sweep
    (:func:`kvnotes.harness.readout.variant_scores`).

    Returns:
        ``[d - b]`` fp32 scores in nats, index ``i`` = position ``b + i`` (``run.recovery`` turns
        them into recoveries).
    """
    b, d = run.pair.field[1], run.pair.decision
    masks = kvpatch.position_masks(len(run.old_cache.layers), d, [[p] for p in range(b, d)])
    return variant_scores(model, run.pair, run.old_cache, run.new_cache, masks, mode, budget_bytes)


# ----------------------------------------------------------------------------------------------
# aggregation


def _value_fn(value: str | Callable[[dict], float | None]) -> Callable[[dict], float | None]:
    return (lambda r: r[value]) if isinstance(value, str) else value


def summary(rows: list[dict], value: str | Callable[[dict], float | None], n_boot: int = 2000, seed: int = 0) -> dict:
    """:func:`kvnotes.harness.stats.summarize` of ``value`` (a column name or ``row -> float``) over rows,
    clustered by their ``scenario`` and ``instance`` columns."""
    get = _value_fn(value)
    return summarize([get(r) for r in rows], [r["scenario"] for r in rows], [r["instance"] for r in rows],
                     n_boot, seed)


def by_family(rows: list[dict], families: Sequence[str] | None = None) -> dict[str, list[dict]]:
    """``{"all": rows, family: its rows, ...}`` over ``families`` (default: those of the rows)."""
    fams = sorted({r["family"] for r in rows}) if families is None else families
    return {"all": rows} | {f: [r for r in rows if r["family"] == f] for f in fams}


def recovery_summary(rows: list[dict], key: str, flipped_key: str | None = None, n_boot: int = 2000,
                     seed: int = 0) -> dict:
    """Mean/median recovery with intervals (unclipped), plus the share of pairs whose decision the
    intervention actually flipped (Wilson CI) when ``flipped_key`` is given."""
    out = summary(rows, key, n_boot, seed)
    if flipped_key:
        out["decision_flipped"] = proportion(sum(bool(r[flipped_key]) for r in rows), len(rows))
    return out


def families_of(ctx, rows: list[dict]) -> list[str]:
    """Every family of the loaded scenarios (also those without flipping pairs), sorted."""
    return sorted({s.family for s in ctx.pairs.scenarios} | {r["family"] for r in rows})


def summaries_by_family(rows: list[dict], value, flipped, families: list[str], n_boot: int = 2000,
                        seed: int = 0) -> dict:
    """:func:`recovery_summary` over all rows (``"all"``) and per family.

    Args:
        value: column name or ``row -> float | None``; rows giving None are left out (not counted
            as non-finite).
        flipped: column name or ``row -> bool``: the patched run took the new run's decision; None
            to omit the flip share.

    Returns:
        ``{"all": summary, <family>: summary, ...}``; families without rows get ``n = 0``. A family
        with two or more scenarios also gets ``by_scenario`` (``{scenario: {n, mean, ci_mean,
        ci_method}}``) and ``disagree``: the two scenarios whose intervals do not overlap and whose
        means differ by at least :data:`kvnotes.harness.stats.DISAGREE_MARGIN`, or None
        (:func:`kvnotes.harness.stats.disagreeing`; issue #53: a family mean over scenarios that
        differ in mechanism is a mixture, not a property of the family).
    """
    get, flip = _value_fn(value), (_value_fn(flipped) if flipped else None)
    out = {}
    for g, rs in by_family(rows, families).items():
        tmp = [{"scenario": r["scenario"], "instance": r["instance"], "_v": v,
                "_f": flip(r) if flip else None} for r in rs if (v := get(r)) is not None]
        out[g] = recovery_summary(tmp, "_v", "_f" if flip else None, n_boot, seed)
        if g != "all":
            out[g] |= scenario_breakdown(tmp, "_v", n_boot, seed)
    return out


def scenario_breakdown(rows: list[dict], value: str | Callable[[dict], float | None], n_boot: int = 2000,
                       seed: int = 0) -> dict:
    """A family's per-scenario means of ``value`` (:func:`summary` of each scenario's rows: ``n``,
    ``mean``, ``ci_mean``, ``ci_method``) and the two scenarios whose intervals do not overlap
    (``disagree``, :func:`kvnotes.harness.stats.disagreeing`); ``{}`` with fewer than two scenarios."""
    scenarios = sorted({r["scenario"] for r in rows})
    if len(scenarios) < 2:
        return {}
    keep = ("n", "mean", "ci_mean", "ci_method")
    per = {sc: {k: v for k, v in summary([r for r in rows if r["scenario"] == sc], value, n_boot, seed).items()
                if k in keep} for sc in scenarios}
    return {"by_scenario": per, "disagree": disagreeing(per)}


def _verdict_cell(rows: list[dict], n_boot: int, seed: int) -> dict:
    """One group's verdict (:func:`kvnotes.harness.stats.verdict_of`) from rows with ``_s`` (selected)
    and ``_c`` (control): the selected result's, the control's and their paired difference's
    summaries (``mean``, ``ci_mean``, ``ci_method``, ``n``, ``n_scenarios``, ``n_instances``)."""
    keep = ("n", "n_scenarios", "n_instances", "mean", "ci_mean", "ci_method")

    def cut(value):
        return {k: v for k, v in summary(rows, value, n_boot, seed).items() if k in keep}

    diff = cut(lambda r: r["_s"] - r["_c"])
    return {"verdict": verdict_of(diff), "selected": cut("_s"), "control": cut("_c"), "difference": diff}


def verdicts(rows: list[dict], selected, control, families: Sequence[str], claim: str, n_boot: int = 2000,
             seed: int = 0) -> dict:
    """Whether a selected result (a ranking's top set, a fitted direction) beats its control on
    held-out pairs, per family and per scenario (issue #53): ``supported`` / ``inconclusive`` /
    ``contradicted`` (:func:`kvnotes.harness.stats.verdict_of` of the paired difference, its interval
    fitted to its clusters, :func:`kvnotes.harness.stats.summarize`).

    A family whose scenarios disagree on the selected result (intervals that do not overlap,
    :func:`kvnotes.harness.stats.disagreeing`) is at most ``inconclusive``: its mean mixes
    scenarios that behave differently, so it is no property of the family; ``disagree`` names the
    two scenarios.

    Args:
        rows: held-out pair rows (``family``, ``scenario``, ``instance``).
        selected: column name or ``row -> float | None``: the selected result (rows where it or the
            control is None are left out).
        control: the same for the control.
        claim: what is compared, in words (e.g. ``"top-k read heads vs k random heads, mean over k"``).

    Returns:
        ``{"claim", "by_family": {"all" | family: cell}}``; a cell is ``{"verdict", "reason",
        "selected", "control", "difference", "scenarios": {scenario: cell without scenarios},
        "disagree"}``.
    """
    sel_fn, ctl_fn = _value_fn(selected), _value_fn(control)
    flat = [r | {"_s": s, "_c": c} for r in rows
            if (s := sel_fn(r)) is not None and (c := ctl_fn(r)) is not None]
    out = {}
    for g, rs in by_family(flat, list(families)).items():
        cell = _verdict_cell(rs, n_boot, seed)
        scen = {sc: _verdict_cell([r for r in rs if r["scenario"] == sc], n_boot, seed)
                for sc in sorted({r["scenario"] for r in rs})}
        apart = disagreeing({sc: c["selected"] for sc, c in scen.items()})
        d = cell["difference"]
        if not rs:
            reason = "no held-out pairs"
        elif d["ci_mean"] is None:
            reason = f"difference {d['mean']:+.3f} on a single instance: no interval"
        else:
            reason = f"difference {d['mean']:+.3f} [{d['ci_mean'][0]:+.3f}, {d['ci_mean'][1]:+.3f}] ({d['ci_method']})"
        if apart:
            a, b = (scen[x]["selected"] for x in apart)
            reason += (f"; scenarios disagree: {apart[0]} {a['mean']:.3f} [{a['ci_mean'][0]:.3f}, {a['ci_mean'][1]:.3f}]"
                       f" vs {apart[1]} {b['mean']:.3f} [{b['ci_mean'][0]:.3f}, {b['ci_mean'][1]:.3f}]")
            if cell["verdict"] == SUPPORTED:
                cell["verdict"] = INCONCLUSIVE
        out[g] = cell | {"reason": reason, "scenarios": scen, "disagree": apart}
    return {"claim": claim, "by_family": out}


def exclusions_by_family(excluded: list[dict], families: list[str]) -> dict:
    """``{family: {reason: count}}`` over excluded pair rows."""
    return {f: exclusion_counts([r for r in excluded if r.get("family") == f]) for f in families}


def pair_counts(ctx, rows: list[dict], excluded: list[dict], families: list[str]) -> dict:
    """The counts a pair probe's aggregates carry: ``n_pairs`` (the suite's pairs, aligned and
    excluded), ``n_flip`` (``rows``: the pairs measured), ``families`` and ``exclusions_by_family``
    (:func:`exclusions_by_family` of ``excluded``)."""
    return {"n_pairs": len(ctx.pairs.pairs) + len(ctx.pairs.excluded), "n_flip": len(rows), "families": families,
            "exclusions_by_family": exclusions_by_family(excluded, families)}


def no_circuit_note(families: list[str], rows: list[dict], excluded: list[dict]) -> dict:
    """Per family: ``"no flipping pairs: no circuit to find"`` where a family has no flipping pair
    (e.g. policy_gate on a 135M model), else the number of flipping pairs."""
    out = {}
    for f in families:
        n = sum(r["family"] == f for r in rows)
        out[f] = n if n else f"no flipping pairs ({sum(r.get('family') == f for r in excluded)} excluded): no circuit to find"
    return out


def worst(rows: list[dict], value: str | Callable[[dict], float | None], ref: float = 0.0) -> float | None:
    """A check's largest deviation ``max |value(row) - ref|`` over rows (None values skipped;
    None without rows)."""
    get = _value_fn(value)
    return max((abs(v - ref) for r in rows if (v := get(r)) is not None), default=None)


# ----------------------------------------------------------------------------------------------
# layer bands


def layer_bands(n_layers: int, spec, units: str = "layer") -> list[dict]:
    """Layer bands, one convention for every probe: ``{"name": "L<lo>-<hi-1>", "layers": [lo, hi)}``.

    Args:
        spec: a number of (near-)equal contiguous bands (``numpy.array_split``), or a list of
            ``[lo, hi]``: with ``units="layer"`` layer indices ``[lo, hi)``, with
            ``units="fraction"`` fractions of depth (``[floor(lo * L + 0.5), floor(hi * L + 0.5))``).

    Raises:
        ModelFitError: (a ``ValueError``) unknown units, more bands than layers, an empty /
            out-of-range band, or a band in layer units that is not whole layers.
    """
    if isinstance(spec, int | np.integer):
        if not 1 <= spec <= n_layers:
            raise ModelFitError(f"layer bands: cannot split the model's {n_layers} layers into {spec} bands "
                                f"(give the probe at most {n_layers})")
        spec, units = [[int(a[0]), int(a[-1]) + 1] for a in np.array_split(np.arange(n_layers), int(spec))], "layer"
    out = []
    for lo, hi in spec:
        if units == "fraction":
            l0, l1 = math.floor(float(lo) * n_layers + 0.5), math.floor(float(hi) * n_layers + 0.5)
        elif units == "layer":
            if float(lo) != int(lo) or float(hi) != int(hi):
                raise ModelFitError(f"layer bands: band [{lo}, {hi}] in layer units must give whole layer indices")
            l0, l1 = int(lo), int(hi)
        else:
            raise ModelFitError(f"band units must be 'fraction' or 'layer', got {units!r}")
        if not 0 <= l0 < l1 <= n_layers:
            raise ModelFitError(f"layer bands: band [{lo}, {hi}] ({units}) gives an empty or out-of-range layer range "
                             f"[{l0}, {l1}) for {n_layers} layers")
        out.append({"name": f"L{l0}-{l1 - 1}", "layers": [l0, l1]})
    return out


# ----------------------------------------------------------------------------------------------
# chain of thought (scenario.variant=cot): the shared generated readout (kvnotes.kv.generate)


def is_cot(ctx) -> bool:
    """The run's scenario uses the chain-of-thought prompt variant (``scenario.variant=cot``)."""
    return ctx.scenario_cfg is not None and ctx.scenario_cfg.get("variant") == "cot"


def cot_selection(ctx, limit: int | None) -> tuple[list, int]:
    """The aligned pairs screened by generation under a ``cot_max_pairs`` cap, round-robin over
    scenarios so a cap keeps each one (:func:`kvnotes.harness.selection.round_robin`), and how many
    were left out (counted ``beyond_max_pairs``, no rows)."""
    order = round_robin([pair_row(p) for p in ctx.pairs.pairs])
    keep = order if limit is None else order[: int(limit)]
    return [ctx.pairs.pairs[i] for i in keep], len(ctx.pairs.pairs) - len(keep)


def cot_marker(ctx, pair):
    """The pair's answer-marker test (:func:`kvnotes.kv.generate.answer_marker`; after the think
    block on a thinking model)."""
    sc = pair.spec.instance.scenario
    return answer_marker(ctx.bundle.tokenizer, sc.variants[pair.spec.variant].answer_marker, ctx.thinking)


def cot_unreached(ctx, side: str, chain) -> str:
    """Exclusion reason of a chain that did not reach its marker: ``<side>_no_marker`` or
    ``<side>_truncated_in_think`` (:func:`kvnotes.kv.generate.unreached_reason`)."""
    return unreached_label(ctx.bundle.tokenizer, side, chain, ctx.thinking)


def scan_layers(n_layers: int, layers: Sequence[int] | None, n_scan: int | None, key: str = "probe.layers") -> list[int]:
    """Layers to scan: ``layers`` (sorted, deduplicated) or ``n_scan`` evenly spaced over
    ``[0, n_layers - 2]`` (all of them when ``n_scan`` is None or larger). A probe calls it before
    any work, as soon as the model's depth is known.

    Args:
        key: the config key ``layers`` came from, for the message.

    Raises:
        ModelFitError: (a ``ValueError``) an empty list, a layer outside ``[0, n_layers)`` (a negative
            one too: no index wraps around), or a model with a single layer; one line naming ``key``.
    """
    if layers is not None:
        out = sorted({int(l) for l in layers})
        if not out:
            raise ModelFitError(f"{key}=[]: give at least one layer, or null to scan n_layers_scan of them")
        bad = [l for l in out if not 0 <= l < n_layers]
        if bad:
            raise ModelFitError(f"{key}={list(layers)}: layer{'s' if len(bad) > 1 else ''} {bad} outside the "
                                f"model's {n_layers} layers (0 to {n_layers - 1})")
        return out
    if n_layers < 2:
        raise ModelFitError(f"a layer scan needs at least two layers, the model has {n_layers}")
    top = n_layers - 2
    if n_scan is None or int(n_scan) >= top + 1:
        return list(range(top + 1))
    return sorted({int(round(x)) for x in np.linspace(0, top, max(1, int(n_scan)))})
