"""The KV cache and what acts on it: cache construction and views (:mod:`.cache`), patch masks,
dense or factored (:mod:`.masks`), the batched patched readout (:mod:`.patch`: activation patching of K/V without a cache per variant), attention hooks
(:mod:`.capture`), attention knockouts (:mod:`.knockout`), RoPE delta rotations of cached keys
(:mod:`.rope`), the generated readout (:mod:`.generate`: batched decoding of variants up to an
answer marker), the decision at the decision position and whether the model owns it
(:mod:`.decision`) and the activation engine (:mod:`.engine`: sites and interventions on nnsight or
TransformerLens). Imports nothing from kvnotes.scenarios or the harness."""
