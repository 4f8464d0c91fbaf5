"""The generated readout (issue #20; the paper's chain-of-thought regime, docs/design.md §5): decode
a chain from each variant cache, greedily or by seeded sampling, until the variant reaches its
answer marker, and read the decision right after the marker exactly as the direct readout reads it
at the decision position: the next-token log-probs of that step (fp32 log-softmax over the
vocabulary), from which :func:`kvnotes.harness.readout.first_token_scores` gives the score and the
top-1 gives the owned decision.

All variants decode in one batch. Variants given as one batch-1 prefix cache share it: the batch is
an expanded *view* of it (no per-variant copy; each step's forward appends the fed tokens). A chain
that does not reach its marker within ``max_new_tokens`` (or stops on an end token first) is
marked ``reached=False``: callers exclude it and count it (``no_answer_marker``), never score it.
With ``max_new_tokens=0`` nothing is generated and the decision is read after the fed token, which
is the direct readout (``tests/kv/test_generate.py`` checks both equal).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvnotes.kv import cache as kvcache

#: ``reached(generated ids) -> bool``: whether a chain has just completed its answer marker.
MarkerTest = Callable[[list[int]], bool]


@dataclass
class Chain:
    """One generated chain.

    Attributes:
        ids: the generated token ids (through the marker when it was reached).
        reached: whether the marker was reached (the decision was read after ``ids``).
        stopped: why decoding ended: ``"marker"``, ``"max_new_tokens"`` or ``"end_token"``.
    """

    ids: list[int]
    reached: bool
    stopped: str

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def marker_at(self) -> int | None:
        """Index in ``ids`` of the token that completed the marker (the decision is read right after
        it), None when the marker was not reached."""
        return len(self.ids) - 1 if self.reached and self.ids else None

    def record(self) -> dict:
        """The chain as a record keeps it: ``ids``, ``length``, ``marker_at``, ``reached``, ``stopped``."""
        return {"ids": list(self.ids), "length": self.length, "marker_at": self.marker_at,
                "reached": self.reached, "stopped": self.stopped}


@dataclass
class Generated:
    """What :func:`generate` returns.

    Attributes:
        chains: one :class:`Chain` per variant.
        logprobs: fp32 ``[V, vocab]`` next-token log-probs after each chain's marker (the decision
            distribution); rows of chains that did not reach it are NaN.
    """

    chains: list[Chain]
    logprobs: torch.Tensor

    @property
    def reached(self) -> torch.Tensor:
        """bool ``[V]``: chains whose decision was read."""
        return torch.tensor([c.reached for c in self.chains])


def token_marker(marker_ids: Sequence[int]) -> MarkerTest:
    """A marker test on token ids: the chain ends with ``marker_ids``."""
    m = list(marker_ids)
    return lambda ids: len(ids) >= len(m) and ids[-len(m):] == m


def text_marker(tokenizer, marker: str) -> MarkerTest:
    """A marker test on text: the decoded chain ends with ``marker`` (trailing spaces ignored). The
    marker's own tokenisation inside the chain does not matter; a marker that ends inside a token
    (the token carries the answer too) is not reached, so that chain is excluded, not misread."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True).rstrip(" ").endswith(marker)


@torch.no_grad()
def generate(model, cache: DynamicCache, tokens: torch.Tensor | int, pos: int, max_new_tokens: int,
             reached: MarkerTest | None = None, stop_ids: Sequence[int] = (), temperature: float = 0.0,
             generator: torch.Generator | None = None, n_variants: int | None = None) -> Generated:
    """Decode a chain from each variant and read the decision after its marker.

    Args:
        cache: the variants' prefix caches over ``[0, pos)``: batch ``V``, or batch 1 shared by all
            variants (an expanded view, not copied). Left unchanged.
        tokens: the token fed at ``pos`` (the prompt's last token), ``[V]`` or one id for all.
        pos: the position of that token (= the prefix length).
        max_new_tokens: most tokens generated per chain; 0 reads the decision after the fed token
            (the direct readout).
        reached: the marker test (:func:`token_marker`, :func:`text_marker`); required when
            ``max_new_tokens > 0``.
        stop_ids: end tokens: a chain that emits one before its marker stops unreached.
        temperature: 0 greedy; > 0 samples from ``softmax(logits / temperature)`` with ``generator``.
        n_variants: ``V`` when ``cache`` and ``tokens`` are both batch 1.

    Returns:
        :class:`Generated` (chains and the decision log-probs ``[V, vocab]``).

    Raises:
        ValueError: ``max_new_tokens > 0`` without a marker test, or batch sizes that disagree.
    """
    if max_new_tokens > 0 and reached is None:
        raise ValueError("a chain needs a marker test (reached=) to know where the decision is read")
    tok = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    B = cache.layers[0].keys.shape[0]
    V = max(B, len(tok), n_variants or 1)
    if B not in (1, V) or len(tok) not in (1, V):
        raise ValueError(f"cache batch {B} and {len(tok)} tokens for {V} variants")
    config = None if isinstance(cache, kvcache.AllSlotCache) else model.config
    work = kvcache.expand_cache(cache, config, V)
    feed = tok.expand(V).reshape(V, 1).to(model.device)
    chains = [Chain([], False, "max_new_tokens") for _ in range(V)]
    decision: torch.Tensor | None = None                   # [V, vocab], NaN until read
    live = list(range(V))                                   # rows still decoding (all rows are fed)
    step = 0
    while live:
        lp = kvcache.continuation_logprobs(model, work, feed, pos + step, last_only=True)[:, -1].cpu()
        if decision is None:
            decision = torch.full_like(lp, float("nan"))
        nxt = _choose(lp, temperature, generator)
        still = []
        for i in live:
            chain = chains[i]
            if max_new_tokens == 0 or (reached is not None and chain.ids and reached(chain.ids)):
                decision[i] = lp[i]
                chain.reached, chain.stopped = True, "marker"
                continue
            if len(chain.ids) >= max_new_tokens:
                continue                                    # stopped == "max_new_tokens"
            t = int(nxt[i])
            chain.ids.append(t)
            if t in stop_ids:
                chain.stopped = "end_token"
                continue
            still.append(i)
        live = still
        feed = nxt.view(V, 1).to(model.device)              # finished rows keep decoding (ignored)
        step += 1
    assert decision is not None                            # the loop runs at least once
    return Generated(chains, decision)


def _choose(lp: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens ``[V]``: argmax, or a sample at ``temperature``."""
    if temperature <= 0:
        return lp.argmax(-1)
    return torch.multinomial(torch.softmax(lp / temperature, -1), 1, generator=generator).view(-1)


def answer_marker(tokenizer, marker: str, thinking: bool = False, close: str = "</think>") -> MarkerTest:
    """The marker test of a generated readout: :func:`text_marker`, and with ``thinking`` only after
    the think block's closing tag ``close`` (a marker inside the reasoning is not the answer)."""
    if not thinking:
        return text_marker(tokenizer, marker)

    def reached(ids: list[int]) -> bool:
        text = tokenizer.decode(ids, skip_special_tokens=True)
        at = text.find(close)
        return at >= 0 and text[at + len(close):].rstrip(" ").endswith(marker)
    return reached


def unreached_reason(tokenizer, chain: Chain, thinking: bool = False, close: str = "</think>") -> str | None:
    """Why a chain's decision was not read: None (it was), ``"truncated_in_think"`` (a thinking
    chain that never closed its think block: excluded and counted, never scored) or
    ``"no_answer_marker"``."""
    if chain.reached:
        return None
    if thinking and close not in tokenizer.decode(chain.ids, skip_special_tokens=True):
        return "truncated_in_think"
    return "no_answer_marker"


def unreached_label(tokenizer, side: str, chain: Chain, thinking: bool = False) -> str:
    """The exclusion reason of a chain that missed its marker, named for whose chain it was:
    ``<side>_no_marker`` or ``<side>_truncated_in_think`` (:func:`unreached_reason`)."""
    why = unreached_reason(tokenizer, chain, thinking)
    return f"{side}_{'no_marker' if why == 'no_answer_marker' else why}"


def owned_side(logprobs: torch.Tensor, pair) -> str | None:
    """Which candidate the decision after the marker names, read as the direct readout reads the
    decision position: ``"old"`` / ``"new"`` when the vocabulary top-1 of ``logprobs`` (``[vocab]``)
    is that candidate's first token, None when it is neither (not an owned decision)."""
    top = int(logprobs.argmax())
    return "old" if top == pair.cand_old[0] else "new" if top == pair.cand_new[0] else None


def stop_tokens(tokenizer) -> list[int]:
    """End-of-turn token ids that stop a chain (``eos`` and ChatML's ``<|im_end|>`` where known)."""
    ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id)
