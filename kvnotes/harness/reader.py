"""The decision of a whole prompt read under the run's readout, for a probe that builds its caches
itself over whole prompts (compositions of precompiled chunks, growing conversations) instead of
patching a pair's prefix caches (:mod:`kvnotes.harness.protocol`).

The probe builds its cache over :meth:`PromptReader.fed` of the prompt's tokens, by any method of
its own, and hands it to :meth:`PromptReader.read`:

- **direct** (``scenario.variant=direct``): the cache holds the whole prompt; the decision is the
  next-token distribution at its last position (the logits the building forward computed).
- **generated** (``scenario.variant=cot``): the cache holds all but the prompt's last token; from
  that token a chain decodes greedily (:func:`kvnotes.kv.generate.generate`, at most
  ``cot_max_new_tokens`` tokens) and the decision is read right after the scenario's answer marker
  (after the think block on a thinking model); a chain that misses it is reported, never scored.

:meth:`PromptReader.read_prompt` is the reference of both: the plain full prefill of a prompt,
read the same way. Either way the probe sees :class:`Reads`, whose rows mean the same under both
readouts; what only a chain has comes from :meth:`Reads.chain_columns` (nothing under direct).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvnotes.harness.protocol import Readout, readout_of
from kvnotes.harness.timing import timed
from kvnotes.kv import cache as kvcache
from kvnotes.kv.generate import Chain, MarkerTest, answer_marker, generate, owned_side, stop_tokens, unreached_label
from kvnotes.ops import compose as kvcompose


@dataclass
class Reads:
    """Decisions of ``B`` prompts (or variants of one) read under the run's readout.

    Attributes:
        logprobs: fp32 ``[B, vocab]`` next-token log-probs: at the prompt's last position (direct)
            or right after the chain's answer marker (generated; NaN rows where a chain missed it).
        chains: the generated chains (:class:`kvnotes.kv.generate.Chain`), None under direct.
        logits: fp32 ``[B, vocab]`` raw logits at the last position when the building forward gave
            them (direct), else None (a generated decision is read as log-probs).
        prefill_ms: wall time of building the cache (:meth:`PromptReader.read_prompt` only).
        decode_ms: wall time of decoding the chains (0 under direct).
        unreached: per row, the reason of a chain that missed its marker (``<label>_no_marker``,
            ``<label>_truncated_in_think``), else None; None under direct.
    """

    logprobs: torch.Tensor
    chains: list[Chain] | None = None
    logits: torch.Tensor | None = None
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    unreached: list[str | None] | None = None

    def take(self, rows: list[int]) -> "Reads":
        """These reads at ``rows`` (in that order), with the same wall times."""
        return Reads(self.logprobs[rows], None if self.chains is None else [self.chains[i] for i in rows],
                     None if self.logits is None else self.logits[rows], self.prefill_ms, self.decode_ms,
                     None if self.unreached is None else [self.unreached[i] for i in rows])

    def reached(self, i: int) -> bool:
        """Row ``i``'s decision was read (always under direct)."""
        return self.chains is None or self.chains[i].reached

    def side(self, i: int, pair) -> str | None:
        """The candidate row ``i`` decides for, ``"old"`` / ``"new"``: by the sign of its first-token
        score ``lp[new] - lp[old]`` (direct), the owned top-1 after its marker (generated,
        :func:`kvnotes.kv.generate.owned_side`; None when it is neither candidate or the chain missed
        its marker)."""
        lp = self.logprobs[i]
        if self.chains is None:
            return "new" if float(lp[pair.cand_new[0]] - lp[pair.cand_old[0]]) > 0 else "old"
        return owned_side(lp, pair) if self.chains[i].reached else None

    def chain_ids(self, i: int) -> list[int]:
        """Row ``i``'s generated tokens (none under direct): what follows the prompt before the answer."""
        return [] if self.chains is None else list(self.chains[i].ids)

    def decision(self, i: int) -> torch.Tensor:
        """fp32 ``[vocab]`` of row ``i`` to compare decisions by (:func:`kvnotes.ops.compose.decision_metrics`):
        its raw logits when the readout has them, else its log-probs (a log-softmax is its own logits)."""
        return (self.logits if self.logits is not None else self.logprobs)[i]

    def chain_columns(self, i: int, *, chain: str | None = None, reached: str | None = None,
                      unreached: str | None = None, decode_ms: str | None = None,
                      same: tuple[str, list[int]] | None = None, text: tuple[str, Any] | None = None) -> dict:
        """What only row ``i``'s chain has, under the keys the probe names: ``chain`` its record
        (:meth:`kvnotes.kv.generate.Chain.record`), ``reached``, ``unreached`` its exclusion reason
        (None when it reached its marker), ``decode_ms`` the decoding's wall time, ``same``
        ``(key, ids)``: whether it decoded ``ids`` token for token, ``text`` ``(key, tokenizer)``: its
        text (None without a tokenizer). None under the direct readout, which reads no chain."""
        if self.chains is None:
            return {}
        c = self.chains[i]
        named = {chain: c.record(), reached: c.reached, decode_ms: self.decode_ms,
                 unreached: None if self.unreached is None else self.unreached[i]}
        out = {key: value for key, value in named.items() if key is not None}
        if same is not None:
            out[same[0]] = c.ids == list(same[1])
        if text is not None:
            key, tok = text
            out[key] = None if tok is None else tok.decode(c.ids, skip_special_tokens=True)
        return out


@dataclass(frozen=True)
class PromptReader:
    """The run's readout of whole prompts (module docstring); :func:`prompt_reader` makes one.

    Attributes:
        readout: ``"direct"`` or ``"generated"``.
        model: the model.
        tokenizer: its tokenizer (the unreached reasons name a truncated think block).
        max_new_tokens: most tokens generated per chain (generated).
        marker: the scenario's answer-marker test (generated; None under direct).
        stop_ids: end tokens that stop a chain unreached.
        thinking: the model reasons in a think block.
    """

    readout: Readout
    model: object
    tokenizer: object = None
    max_new_tokens: int = 0
    marker: MarkerTest | None = None
    stop_ids: tuple[int, ...] = ()
    thinking: bool = False

    @property
    def static(self) -> bool | None:
        """The ``static`` a composition for this readout may use (:func:`kvnotes.ops.compose.compose`):
        its default (None) under direct, False under generated (decoding grows the cache)."""
        return False if self.readout == "generated" else None

    def fed(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens the probe's cache must hold before :meth:`read` (``[..., L]`` ->): all of them
        (direct) or all but the last, which the chain decodes from (generated)."""
        return ids[..., :-1] if self.readout == "generated" else ids

    def unreached_reason(self, label: str, reads: Reads, i: int = 0) -> str:
        """The exclusion reason of row ``i``'s chain, which missed its marker, named by ``label``:
        ``<label>_no_marker`` or ``<label>_truncated_in_think`` (:func:`kvnotes.kv.generate.unreached_label`)."""
        assert reads.chains is not None
        return unreached_label(self.tokenizer, label, reads.chains[i], self.thinking)

    @torch.no_grad()
    def read(self, cache, logprobs: torch.Tensor | None, ids: torch.Tensor, logits: torch.Tensor | None = None,
             label: str = "chain") -> Reads:
        """The decisions of a cache the probe built over :meth:`fed` of ``ids``.

        Args:
            cache: its cache (batch ``B``; left unchanged under the generated readout, which decodes
                on an expanded view; unused under direct).
            logprobs: fp32 ``[B, vocab]`` at the last fed position, from the building forward
                (direct; None: the log-softmax of ``logits``; unused under generated).
            ids: ``[B, L]`` or ``[L]`` (one prompt, ``B = 1``): the prompts' tokens.
            logits: fp32 ``[B, vocab]`` raw logits of the building forward (direct), when it has them.
            label: names a missed marker's reason (``<label>_no_marker``).

        Returns:
            :class:`Reads` of ``B`` rows.

        Raises:
            ValueError: generated, ``max_new_tokens > 0`` without a marker test.
        """
        if self.readout == "direct":
            assert logprobs is not None or logits is not None
            return Reads(torch.log_softmax(logits, -1) if logprobs is None else logprobs, logits=logits)
        token = ids[..., -1]
        pos = ids.shape[-1] - 1
        ms, gen = timed(lambda: generate(self.model, cache, int(token) if token.dim() == 0 else token, pos,
                                         self.max_new_tokens, self.marker, self.stop_ids))
        reads = Reads(gen.logprobs, gen.chains, decode_ms=ms)
        reads.unreached = [None if c.reached else self.unreached_reason(label, reads, i) for i, c in enumerate(gen.chains)]
        return reads

    @torch.no_grad()
    def read_prompt(self, ids: torch.Tensor, label: str = "full") -> Reads:
        """The reference: the plain full prefill of ``ids`` (``[L]`` or ``[B, L]``) read under the
        readout (direct: one forward computing the last position's logits,
        :func:`kvnotes.ops.compose.full_logits`; generated: :func:`kvnotes.kv.cache.prefill` of all
        but the last token, then :meth:`read`), with the prefill's wall time."""
        if self.readout == "direct":
            ms, logits = timed(lambda: kvcompose.full_logits(self.model, ids))
            return Reads(torch.log_softmax(logits, -1), logits=logits, prefill_ms=ms)
        ms, cache = timed(lambda: kvcache.prefill(self.model, self.fed(ids)))
        reads = self.read(cache, None, ids, label=label)
        reads.prefill_ms = ms
        return reads


def prompt_reader(ctx, scenario) -> PromptReader:
    """The run's :class:`PromptReader` for prompts of ``scenario`` (its answer marker under
    ``scenario.variant=cot``; ``ctx.cfg.cot_max_new_tokens`` tokens per chain)."""
    readout = readout_of(ctx)
    if readout == "direct":
        return PromptReader("direct", ctx.bundle.model, ctx.bundle.tokenizer)
    tok, thinking = ctx.bundle.tokenizer, bool(getattr(ctx, "thinking", False))
    marker = answer_marker(tok, scenario.variants[ctx.scenario.variant].answer_marker, thinking)
    return PromptReader("generated", ctx.bundle.model, tok, int(ctx.cfg.cot_max_new_tokens), marker,
                        tuple(stop_tokens(tok)), thinking)
