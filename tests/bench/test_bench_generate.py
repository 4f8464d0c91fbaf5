"""bench generate's parting check: where a batched chain and its per-variant chain differ, the step
and the log-prob margin there are those of a teacher-forced forward."""

from __future__ import annotations

import torch

from kvnotes.kv import cache as kvcache
from kvnotes.kv.generate import generate, token_marker
from kvnotes.bench.generate import TIE_NATS, parting
from tests.helpers import VOCAB, build_tiny


@torch.no_grad()
def test_parting_finds_the_step_and_its_margin():
    model = build_tiny("qwen3")
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(0))
    d = len(ids) - 1
    prefix = kvcache.prefill(model, ids[:d])
    greedy = generate(model, prefix, int(ids[d]), d, 6, token_marker([-1])).chains[0].ids
    for step in (0, 3):
        lp = kvcache.continuation_logprobs(model, kvcache.view(prefix, model.config),
                                           torch.tensor([int(ids[d]), *greedy[:step]]), d)[0, -1]
        other = int(lp.topk(2).indices[1])                 # the runner-up at that step
        if other == greedy[step]:
            other = int(lp.topk(2).indices[0])
        changed = [*greedy[:step], other, *greedy[step + 1:]]
        t, margin = parting(model, prefix, int(ids[d]), d, greedy, changed)
        assert t == step
        assert abs(margin - float(lp[greedy[step]] - lp[other])) < 1e-5
        assert margin > 0                                  # greedy picked the larger log-prob
    assert TIE_NATS[torch.float32] < TIE_NATS[torch.bfloat16]


def test_a_chain_that_ends_earlier_is_no_tie():
    model = build_tiny("llama")
    prefix = kvcache.prefill(model, torch.arange(3, 10))
    assert parting(model, prefix, 11, 7, [5, 6, 7], [5, 6]) == (2, float("inf"))
