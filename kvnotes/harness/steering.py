"""Residual-stream interventions along directions (``resid_post`` at the note positions ``[b, d)``,
TransformerLens hook names), for the ``direction`` circuit (``docs/probes/direction.md``): capture a
clean run's note residuals, build the sufficiency additions (a difference projected on a direction,
its orthogonal complement, norm-matched random controls) and the necessity ablations (projections
set to a target), and score a run with those additions (an :class:`kvnotes.kv.engine.Engine` resumed
at ``b``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvnotes.harness.readout import PairRun, first_token_scores
from kvnotes.kv.engine import Engine, Intervention, Site


def capture_notes(engine: Engine, ids: torch.Tensor, prefix, b: int, d: int, layers: Sequence[int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residuals (site ``resid_post``) at the note positions ``[b, d)`` of a clean run, resumed at ``b``.

    Args:
        ids: ``[T]`` prompt ids (``T > d``).
        prefix: the run's clean prefix cache over ``[0, b)`` (batch 1; not modified).
        layers: decoder layers to capture.

    Returns:
        (``[len(layers), d - b, hidden]`` fp32 residuals, ``[1, vocab]`` fp32 log-probs at ``d``).
    """
    out = engine.run(ids[b: d + 1], capture=[Site("resid_post", l) for l in layers], cache=prefix, start=b)
    acts = torch.stack([out.acts[Site("resid_post", l)][0, : d - b].float() for l in layers])
    return acts, out.logprobs[:, -1]


def random_directions(rng: np.random.Generator, n: int, dim: int) -> torch.Tensor:
    """``[n, dim]`` fp32 unit vectors, isotropic (normalised standard Gaussian draws from ``rng``)."""
    g = torch.from_numpy(rng.standard_normal((n, dim))).float()
    return g / g.norm(dim=-1, keepdim=True)


def injections(delta: torch.Tensor, u: torch.Tensor, rand: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sufficiency additions at one layer.

    Args:
        delta: ``[P, hidden]`` clean-minus-corrupt residual difference at the note positions.
        u: ``[hidden]`` unit direction.
        rand: ``[R, hidden]`` unit random directions.

    Returns:
        ``direction`` ``[P, hidden]`` = ``(delta·u) u``; ``orthogonal`` = ``delta - direction``;
        ``full`` = ``delta``; ``random`` ``[R, P, hidden]`` = ``(delta·u) r̂`` (same norm as
        ``direction`` at every position, hence per pair); ``random_subspace`` ``[R, P, hidden]`` =
        ``(delta·r̂) r̂``, the part of the difference inside a random one-dimensional subspace,
        rescaled per draw to the total norm of ``direction`` (zero where that norm is zero).
    """
    c = delta @ u                                             # [P]
    along = c[:, None] * u[None]
    sub = (delta @ rand.T).T[:, :, None] * rand[:, None, :]   # [R, P, hidden]
    scale = along.norm() / sub.flatten(1).norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return {"direction": along, "orthogonal": delta - along, "full": delta,
            "random": c[None, :, None] * rand[:, None, :], "random_subspace": sub * scale[:, None, None]}


def ablations(x: torch.Tensor, dirs: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Necessity additions: ``(mu_k - x_p·e_k) e_k`` per direction ``e_k``, so the projection of
    every note residual on ``e_k`` becomes ``mu_k``.

    Args:
        x: ``[P, hidden]`` clean note residuals.
        dirs: ``[K, hidden]`` unit directions; mu: ``[K]`` target projections.

    Returns:
        ``[K, P, hidden]``.
    """
    proj = x @ dirs.T                                         # [P, K]
    return ((mu[None] - proj).T)[:, :, None] * dirs[:, None, :]


def added_scores(engine: Engine, run: PairRun, ids: torch.Tensor, prefix, layer: int, values: torch.Tensor
                 ) -> torch.Tensor:
    """Scores of variants of a run resumed at ``b`` with ``values`` added to the residual (site
    ``resid_post`` of ``layer``) at the note positions ``[b, d)``.

    Args:
        ids: ``[T]`` prompt ids of the run (old for sufficiency, new for necessity).
        prefix: that run's clean prefix cache over ``[0, b)``.
        values: ``[V, d - b, hidden]``.

    Returns:
        ``[V]`` fp32 first-token scores (nats).
    """
    pair = run.pair
    b, d = pair.field[1], pair.decision
    iv = Intervention(Site("resid_post", layer), list(range(b, d)), values, mode="add")
    lp = engine.run(ids[b: d + 1][None].expand(values.shape[0], -1), [iv], cache=prefix, start=b).logprobs
    return first_token_scores(lp[:, -1], pair).float().cpu()
