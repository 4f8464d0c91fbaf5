"""The cache edits of :mod:`kvnotes.ops.edit` as a serving engine runs them: the cached positions are
copied into one reused KV pool and the recomputed tokens go through ONE forward at their positions,
replayed as a CUDA graph per token layout on GPU (the pool and graphs of
:class:`kvnotes.ops.slots.SlotRunner`, which :class:`kvnotes.ops.compose.ComposeRunner` runs on too).

The edited states equal :mod:`kvnotes.ops.edit`'s: each recomputed token attends to every slot
before its own, which holds either the cached (stale) state or, for a position recomputed earlier in
the same forward, its new state; the field refresh (:func:`kvnotes.ops.edit.refresh_field`), the
appended erratum or hoisted suffix (:func:`kvnotes.ops.edit.extend_from`), both at once, and a
selective recompute (:func:`kvnotes.ops.edit.selective`) are each one such forward: the positions
and the kept prefix of a method of the registry (:meth:`kvnotes.ops.methods.EditMethod.positions`,
:meth:`~kvnotes.ops.methods.EditMethod.keep`; :meth:`EditRunner.apply`). The eager path
pays Python and kernel launches per layer for a few-token forward (a 2-token field refresh of a
random-weight Qwen3-8B shape at 32k tokens took 39 ms on an H200 against a 3.9-ms floor); the
graph replays them in one launch (15 ms there, ``docs/bench/bench_edit_gpu_h200.txt``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from kvnotes.kv.cache import check_all_slots
from kvnotes.ops.methods import METHODS, EditMethod, EditSource, Geometry
from kvnotes.ops.slots import SlotCache, SlotRunner, position_runs


class EditRunner:
    """Cache edits on one KV pool of ``max_len`` slots (batch 1).

    Each call copies the cached positions it keeps into the pool (the source cache is left
    unchanged), forwards the recomputed tokens at their positions in one forward, and returns
    ``(pool, logits)``: the pool (a :class:`kvnotes.ops.slots.SlotCache` holding the edited
    prompt's positions, valid until the next call) and the fp32 logits ``[1, vocab]`` of the last
    recomputed position.

    Args:
        model: a causal LM without sliding-window layers.
        max_len: slots of the pool (the longest edited prompt).
        graphs: capture CUDA graphs (default: on CUDA); each token layout (number of recomputed
            tokens, runs of positions) is captured in its first call.

    Raises:
        ValueError: sliding-window layers (use :mod:`kvnotes.ops.edit`), or CUDA graphs on a CPU model.
    """

    def __init__(self, model, max_len: int, graphs: bool | None = None) -> None:
        self.model = model
        self.runner = SlotRunner(model, max_len, graphs=graphs)

    @property
    def pool(self) -> SlotCache:
        return self.runner.cache

    @torch.no_grad()
    def recompute(self, cached: DynamicCache, keep: int, ids: torch.Tensor,
                  positions: Sequence[int]) -> tuple[SlotCache, torch.Tensor]:
        """Keep positions ``[0, keep)`` of ``cached`` and forward ``ids[positions]`` at ``positions``.

        Args:
            cached: an all-slot cache (:class:`kvnotes.kv.cache.AllSlotCache`) over at least ``keep``
                positions.
            keep: cached positions copied into the pool; those in ``positions`` are overwritten.
            ids: ``[n]`` token ids of the edited prompt (only ``ids[positions]`` are read).
            positions: the recomputed positions (any order, deduplicated); those ``>= keep`` must
                continue ``keep`` without a gap.

        Returns:
            (the pool, holding ``max(keep, max(positions) + 1)`` positions; fp32 logits ``[1, vocab]``
            of the last recomputed position).

        Raises:
            ValueError: no positions, a gap after ``keep``, a cache shorter than ``keep``, or an
                edited prompt longer than the pool.
        """
        pos = sorted(set(int(p) for p in positions))
        if not pos:
            raise ValueError("recompute needs at least one position")
        held = check_all_slots(cached)
        if keep > held:
            raise ValueError(f"keep={keep} but the cache holds {held} positions")
        after = [p for p in pos if p >= keep]
        if after and after != list(range(keep, keep + len(after))):
            raise ValueError(f"positions past keep={keep} must continue it without a gap")
        total = max(keep, pos[-1] + 1)
        pool = self.runner.cache
        if total > pool.max_len:
            raise ValueError(f"edited prompt of {total} positions for a pool of {pool.max_len} slots")
        for l, layer in enumerate(cached.layers):        # the kept positions, every layer (stale left as it is)
            pool.pool_keys[0, l, :, :keep].copy_(layer.keys[0, :, :keep])
            pool.pool_values[0, l, :, :keep].copy_(layer.values[0, :, :keep])
        pool.set_length(total)
        dev = self.model.device
        slots = torch.tensor(pos, dtype=torch.long, device=dev)
        logits = self.runner.forward_slots(ids.to(dev)[slots].view(1, -1), slots, position_runs(pos))
        return pool, logits[:, -1].float()

    def apply(self, method: EditMethod, src: EditSource, picks: Sequence[int] = ()) -> tuple[SlotCache, torch.Tensor]:
        """``method``'s edit of ``src`` (:func:`kvnotes.ops.methods.apply`) in one forward: the kept
        prefix and recomputed positions of the registry (:meth:`kvnotes.ops.methods.EditMethod.keep`,
        :meth:`~kvnotes.ops.methods.EditMethod.positions`); ``picks`` are a ranked method's positions.
        With both a field refresh and a prompt, the field's tokens come from ``src.new_ids``.

        Raises:
            ValueError: a method that is not one forward on a kept cache (a re-prefill, a copy, no
                edit), or as :meth:`recompute`.
        """
        if method.prompt is None:
            return self._run(method, src.stale, src.new_ids, src.geometry(), picks)
        p = src.prompt(method.prompt)
        ids = p.ids
        if method.refresh:
            a, b = src.field
            ids = torch.cat([ids[:a], src.new_ids[a:b].to(ids.device), ids[b:]])
        return self._run(method, p.cache, ids, Geometry(src.field, src.decision, p.reuse, p.end), picks)

    def _run(self, method: EditMethod, cached: DynamicCache, ids: torch.Tensor, g: Geometry,
             picks: Sequence[int] = ()) -> tuple[SlotCache, torch.Tensor]:
        return self.recompute(cached, method.keep(g), ids, method.positions(g, picks))

    def refresh_field(self, stale: DynamicCache, new_ids: torch.Tensor,
                      field: tuple[int, int]) -> tuple[SlotCache, torch.Tensor]:
        """:func:`kvnotes.ops.edit.refresh_field`: the field span ``[a, b)`` recomputed from
        ``new_ids``, every other position of ``stale`` kept."""
        return self._run(METHODS["refresh_field"], stale, new_ids, Geometry(field, check_all_slots(stale)))

    def extend_from(self, cached: DynamicCache, ids: torch.Tensor, reuse: int, d: int,
                    field: tuple[int, int] | None = None) -> tuple[SlotCache, torch.Tensor]:
        """:func:`kvnotes.ops.edit.extend_from`: positions ``[0, reuse)`` of ``cached`` kept and
        ``ids[reuse:d]`` forwarded (the ``erratum`` and ``hoist`` methods); with ``field`` (inside
        ``[0, reuse)``) the field span is recomputed from ``ids`` in the same forward (a field
        refresh plus an erratum: ``field_plus_erratum``)."""
        method = METHODS["erratum" if field is None else "field_plus_erratum"]
        return self._run(method, cached, ids, Geometry(field or (0, 0), check_all_slots(cached), reuse, d))

    def selective(self, stale: DynamicCache, new_ids: torch.Tensor, field: tuple[int, int],
                  positions: Sequence[int]) -> tuple[SlotCache, torch.Tensor]:
        """:func:`kvnotes.ops.edit.selective`: the field span and the downstream ``positions``
        recomputed in one forward, every other position of ``stale`` kept."""
        return self._run(METHODS["selective"], stale, new_ids, Geometry(field, check_all_slots(stale)), positions)
