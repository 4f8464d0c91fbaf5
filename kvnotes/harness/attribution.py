"""Direct logit attribution (DLA) of a pair's logit difference to the residual stream's parts: the
embedding, every layer's attention and MLP output, through the final norm's frozen scale
(TransformerLens' ``decompose_resid`` / ``logit_attrs``; ``docs/design.md``, "Circuits").

Used by the ``components`` circuit (``docs/probes/components.md``).
"""

from __future__ import annotations

import torch

from kvnotes.kv.engine import Engine, Site


def residual_parts(engine: Engine, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Residual-stream decomposition of a full forward of ``ids`` (``[T]``).

    Returns:
        ``embed`` ``[T, D]``, ``attn`` / ``mlp`` ``[n_layers, T, D]`` (the residual additions),
        ``final`` ``[T, D]`` (last layer output, before the final norm); fp32.
    """
    L = engine.adapter.n_layers
    sites = [Site("resid_pre", 0), Site("resid_post", L - 1)] + [Site(k, l) for l in range(L) for k in ("attn_out", "mlp_out")]
    acts = engine.run(ids, capture=sites).acts
    return {"embed": acts[Site("resid_pre", 0)][0].float(),
            "attn": torch.stack([acts[Site("attn_out", l)][0] for l in range(L)]).float(),
            "mlp": torch.stack([acts[Site("mlp_out", l)][0] for l in range(L)]).float(),
            "final": acts[Site("resid_post", L - 1)][0].float()}


def decomposition_error(parts: dict[str, torch.Tensor]) -> float:
    """Max abs of ``embed + Σ_l (attn_l + mlp_l) - final`` over positions and dimensions."""
    total = parts["embed"] + parts["attn"].sum(0) + parts["mlp"].sum(0)
    return float((total - parts["final"]).abs().max())


def logit_diff_direction(model, adapter, pair) -> torch.Tensor:
    """The logit-difference direction ``g ⊙ (W_U[cand_new] - W_U[cand_old])``, ``[D]`` fp32
    (first tokens; ``g`` the final norm's effective gain, :meth:`Adapter.final_norm_gain`). Not
    normalised: ``σ · v · x`` is the logit difference of the final residual ``x``."""
    from accelerate.utils import align_module_device

    head = adapter.module(model, "unembed")
    with align_module_device(head):          # an offloaded head (device map) has its weight on meta until then
        row = (head.weight[pair.cand_new[0]] - head.weight[pair.cand_old[0]]).float()
    gain = adapter.final_norm_gain(model)
    return gain * row.to(gain.device)


def final_scale(final: torch.Tensor, eps: float) -> torch.Tensor:
    """The final RMSNorm's scale ``1 / sqrt(mean(x²) + eps)`` per position of the final
    pre-norm residual ``final`` ``[T, D]``; returns ``[T]`` fp32."""
    return torch.rsqrt(final.float().pow(2).mean(-1) + eps)


def direct_logit_attribution(parts: dict[str, torch.Tensor], v: torch.Tensor, p: int, eps: float) -> dict:
    """Direct logit attribution of one run at position ``p``: every residual part (``embed``,
    ``attn`` / ``mlp`` per layer, ``final``) projected on ``v`` and scaled by the run's frozen
    final RMS scale, in nats. ``final`` is the logit difference itself."""
    s = final_scale(parts["final"][p:p + 1], eps)[0]
    return {"embed": float(s * (parts["embed"][p] @ v)), "attn": (s * (parts["attn"][:, p] @ v)).tolist(),
            "mlp": (s * (parts["mlp"][:, p] @ v)).tolist(), "final": float(s * (parts["final"][p] @ v))}


def contributions(old: dict, new: dict, v: torch.Tensor, p: int, eps: float) -> dict:
    """New-minus-old direct logit attribution at position ``p`` (:func:`direct_logit_attribution`
    of each run): ``embed``, ``attn`` / ``mlp`` per layer (lists), ``final`` (the change of the
    logit difference), ``sum_error`` (|embed + Σ - final|), all in nats."""
    a, b = direct_logit_attribution(old, v, p, eps), direct_logit_attribution(new, v, p, eps)
    out = {"embed": b["embed"] - a["embed"], "final": b["final"] - a["final"],
           "attn": [y - x for x, y in zip(a["attn"], b["attn"])], "mlp": [y - x for x, y in zip(a["mlp"], b["mlp"])]}
    return out | {"sum_error": abs(out["embed"] + sum(out["attn"]) + sum(out["mlp"]) - out["final"])}
