"""Component-level analyses (heads, directions, attention vs MLP), run as probes by name."""

from kvnotes.harness import kit
from kvnotes.harness.selection import with_split
from kvnotes.kv.engine import make_engine


def start_circuit(ctx):
    """The common start of a circuit probe: the first-token readout check, the engine of the
    config's ``backend``, the flipping pairs with their prefix caches, and their selection /
    held-out split (``selection_fraction``, ``ctx.seed``).

    Returns:
        (engine, :class:`kvnotes.harness.kit.FlippingSet`, rows tagged with ``split``, selection instance
        ids, held-out instance ids).

    Raises:
        KvnotesError: a readout other than ``first_token``.
    """
    kit.require_first_token(ctx)
    engine = make_engine(ctx.bundle.model, ctx.cfg.backend)
    fs = kit.flipping_pairs(ctx, keep_caches=True)
    rows, sel, held = with_split(fs.rows, float(ctx.cfg.selection_fraction), ctx.seed)
    return engine, fs, rows, sel, held
