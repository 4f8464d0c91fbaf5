"""The probes' patched readout on multi-head latent attention (DeepSeek-V2/V3, issue #24): refused in
one line. The readout writes cached K/V into the attention call's per-head keys and values; MLA caches
its kv latent and shared rotary key and expands per-head K/V from them inside attention, so there is
nothing per-head to write into (the cache-level operations, compose and editing, work on MLA:
tests/ops/test_reposition_arch.py)."""

from __future__ import annotations

import pytest
import torch

from kvnotes.errors import KvnotesError
from kvnotes.kv import cache as kvcache
from kvnotes.kv import patch as kvpatch
from tests.helpers import MLA_ARCHS, build_tiny


@pytest.mark.parametrize("arch", MLA_ARCHS[:2])
@pytest.mark.parametrize("method", ["substitute", "shared"])
def test_patched_readout_on_mla_is_refused_in_one_line(arch, method):
    model = build_tiny(arch)
    old = torch.randint(1, 80, (12,), generator=torch.Generator().manual_seed(0))
    new = old.clone()
    new[3:5] = 7
    base, source = kvcache.prefill(model, old[:10]), kvcache.prefill(model, new[:10])
    masks = kvpatch.position_masks(len(base.layers), 10, [[3], [3, 4]])
    with pytest.raises(KvnotesError, match="latent") as err:
        kvpatch.patched_logits(model, base, source, masks, old[10:11], method=method)
    assert "\n" not in str(err.value)
