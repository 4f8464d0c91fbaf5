"""Architecture adapters: module paths declared as data (``adapters.yaml``) plus config facts.

An :class:`Adapter` tells the probes and circuits where a decoder layer's attention, ``o_proj``,
MLP, norms and rotary embedding live, and gives the head geometry and per-layer attention type read
from the Hugging Face config. Nothing here is model-specific code: a new architecture is a new YAML
entry (``docs/design.md``, "Models and adapters").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, cast

import torch
import yaml

from kvnotes.errors import KvnotesError

_PATH_KEYS = (
    "layers", "attn", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "mlp",
    "pre_attn_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm", "final_norm", "embed",
    "rotary", "unembed",
)
#: Where the rotary sub-vector can sit in transformers' per-layer cache, and its pair layouts.
ROPE_SLOTS = ("keys", "values")
ROPE_PAIRS = ("half", "interleaved")


@cache
def adapter_table() -> dict[str, dict[str, Any]]:
    """The parsed ``adapters.yaml``: ``{model_type: {piece: dotted path or None, optional keys}}``."""
    table = yaml.safe_load((Path(__file__).with_name("adapters.yaml")).read_text())
    for model_type, entry in table.items():
        missing = [k for k in _PATH_KEYS if k not in entry]
        if missing:
            raise KvnotesError(f"adapters.yaml: entry '{model_type}' lacks keys {missing}")
    return table


def _get(root: torch.nn.Module, path: str | None) -> torch.nn.Module | None:
    if path is None:
        return None
    module = root
    for part in path.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


#: Layer types whose cache is one K/V entry per token (transformers' ``config.layer_types`` names).
PER_TOKEN_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def check_per_token(config) -> None:
    """Refuse a model whose layers keep a state that is not one K/V entry per token: linear
    attention, Mamba/SSM or convolution layers (Qwen3-Next, Jamba, Bamba, Zamba2, Falcon-H1,
    RecurrentGemma, Mamba, ...). Editing, patching and re-positioning act on per-token entries; a
    recurrent state folds every earlier token into one tensor, so a field edit or a moved chunk
    cannot be applied to it (the paper's Figure 13a marks these out of scope).

    Raises:
        KvnotesError: one line naming the blocking layer type and how many layers have it.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = list(getattr(text, "layer_types", None) or [])
    blocking = [t for t in types if t not in PER_TOKEN_LAYER_TYPES]
    if blocking:
        kind = max(set(blocking), key=blocking.count)
        raise KvnotesError(
            f"model_type '{config.model_type}' keeps a recurrent state in its '{kind}' layers "
            f"({len(blocking)} of {len(types)} layers): kvnotes edits, patches and moves per-token KV "
            f"entries only, so it refuses this architecture (docs/extending/architecture.md, support table)")


def _rope_layout(model_type: str, rope: dict) -> tuple[str, bool]:
    """``(slot, interleaved)`` of an ``adapters.yaml`` ``rope`` entry (see the file's header).

    Raises:
        KvnotesError: an unknown slot or pair layout.
    """
    slot, pairs = rope.get("slot", "keys"), rope.get("pairs", "half")
    if slot not in ROPE_SLOTS or pairs not in ROPE_PAIRS:
        raise KvnotesError(f"adapters.yaml: '{model_type}' rope {{slot: {slot}, pairs: {pairs}}} "
                           f"(slots: {', '.join(ROPE_SLOTS)}; pairs: {', '.join(ROPE_PAIRS)})")
    return slot, pairs == "interleaved"


@dataclass(frozen=True)
class Adapter:
    """Where the pieces of a decoder-only transformer live, and its attention geometry.

    Attributes:
        model_type: the config's ``model_type`` (key into ``adapters.yaml``).
        paths: dotted module paths (see ``adapters.yaml`` for the meaning of each key).
        n_layers, n_heads, n_kv_heads, head_dim: attention geometry (GQA when
            ``n_kv_heads < n_heads``); ``head_dim`` is the per-head width of the ``o_proj`` input
            (MLA: ``v_head_dim``, narrower than its query/key heads).
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"``.
        sliding_window: window length in tokens for sliding layers, or None.
        rope_theta: per layer rotary base (Gemma-3 uses a local theta on sliding layers).
        norm_gain_offset: an RMSNorm's effective gain is ``weight + norm_gain_offset`` (Gemma
            ``1 + w``, others ``w``).
        final_logit_softcapping: the cap ``c`` of ``logits = c * tanh(z / c)`` (Gemma-2), or None.
        cache_heads, cache_key_dim, cache_value_dim: what transformers stores per layer and token,
            ``keys [B, cache_heads, T, cache_key_dim]`` and ``values [B, cache_heads, T,
            cache_value_dim]``: ``(n_kv_heads, head_dim, head_dim)`` except for MLA (DeepSeek-V2/V3:
            ``(1, kv_lora_rank, qk_rope_head_dim)``, the latent and the shared rotary key).
        rope_slot: the cache tensor that carries the rotary sub-vector, ``"keys"`` (its first
            ``rot_dim`` dims; the rest is copied) or ``"values"`` (MLA: the whole ``k_rot``).
        rope_interleaved: rotary pairs are ``(2j, 2j + 1)`` (DeepSeek) instead of ``rotate_half``'s
            ``(j, j + rot_dim / 2)``.
    """

    model_type: str
    paths: dict[str, str | None]
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope_theta: tuple[float | None, ...] = field(default=())
    norm_gain_offset: float = 0.0
    final_logit_softcapping: float | None = None
    cache_heads: int = 0
    cache_key_dim: int = 0
    cache_value_dim: int = 0
    rope_slot: str = "keys"
    rope_interleaved: bool = False

    @staticmethod
    def check_config(config) -> None:
        """Refuse, before loading, a config whose layers keep a recurrent state
        (:func:`check_per_token`) or whose ``model_type`` has no entry in ``adapters.yaml``.

        Raises:
            KvnotesError: one line naming the blocking layer type, or the model type and the known ones.
        """
        check_per_token(config)
        table = adapter_table()
        if config.model_type not in table:
            raise KvnotesError(
                f"no architecture adapter for model_type '{config.model_type}' "
                f"(known: {', '.join(sorted(table))}); add an entry to kvnotes/models/adapters.yaml"
            )

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "Adapter":
        """Build the adapter of a loaded Hugging Face causal LM.

        Raises:
            KvnotesError: the config's ``model_type`` has no entry in ``adapters.yaml``.
        """
        config: Any = model.config
        table = adapter_table()
        cls.check_config(config)
        text = config.get_text_config(decoder=True)
        entry = table[config.model_type]
        n_layers = text.num_hidden_layers
        n_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
        if entry.get("head_dim"):
            head_dim = int(getattr(text, entry["head_dim"]))
        n_kv = getattr(text, "num_key_value_heads", None) or n_heads
        geometry = {"heads": n_kv, "keys": head_dim, "values": head_dim}
        for key, value in (entry.get("cache") or {}).items():
            geometry[key] = int(value if isinstance(value, int) else getattr(text, value))
        slot, interleaved = _rope_layout(config.model_type, entry.get("rope") or {})
        window = getattr(text, "sliding_window", None)
        types = getattr(text, "layer_types", None)
        if types is None:
            types = ["sliding_attention" if window else "full_attention"] * n_layers
        rope = getattr(text, "rope_parameters", None) or {}
        thetas = []
        for t in types:
            params = rope.get(t, rope) if isinstance(rope, dict) else {}
            thetas.append(params.get("rope_theta") if isinstance(params, dict) else None)
        return cls(
            model_type=config.model_type,
            paths=dict(entry),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            hidden_size=text.hidden_size,
            layer_types=tuple(types),
            sliding_window=window if any(t == "sliding_attention" for t in types) else None,
            rope_theta=tuple(thetas),
            norm_gain_offset=float(table[config.model_type].get("norm_gain_offset", 0.0)),
            final_logit_softcapping=getattr(text, "final_logit_softcapping", None),
            cache_heads=geometry["heads"],
            cache_key_dim=geometry["keys"],
            cache_value_dim=geometry["values"],
            rope_slot=slot,
            rope_interleaved=interleaved,
        )

    def rope_index(self, model: torch.nn.Module):
        """The model's own M-RoPE position function (``get_rope_index`` of Qwen2.5-VL / Qwen3-VL:
        ``(input_ids [B, T], mm_token_type_ids [B, T], image_grid_thw, ...) -> (position_ids [3, B, T],
        deltas)``), or None for a model with 1-D positions."""
        path = self.paths.get("rope_index")
        if not path:
            return None
        owner, _, name = path.rpartition(".")
        return getattr(_get(model, owner) if owner else model, name)

    def layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The decoder layers, length ``n_layers``."""
        return cast(torch.nn.ModuleList, _get(model, self.paths["layers"]))

    def module(self, model: torch.nn.Module, piece: str, layer: int | None = None) -> torch.nn.Module | None:
        """The module for ``piece`` (a key of ``adapters.yaml``), inside decoder layer ``layer``
        for per-layer pieces; None where the architecture has no such piece (e.g. Llama's
        ``post_attn_norm``)."""
        if piece in ("layers", "final_norm", "embed", "rotary", "unembed"):
            return _get(model, self.paths[piece])
        if layer is None:
            raise ValueError(f"piece '{piece}' is per layer: pass layer=")
        return _get(self.layers(model)[layer], self.paths[piece])

    def final_norm_gain(self, model: torch.nn.Module) -> torch.Tensor:
        """The final RMSNorm's effective per-dimension gain ``[D]`` (fp32): ``weight +
        norm_gain_offset``."""
        from accelerate.utils import align_module_device

        norm = _get(model, self.paths["final_norm"])
        with align_module_device(norm):      # an offloaded norm (device map) has its weight on meta until then
            return cast(torch.Tensor, norm.weight).float() + self.norm_gain_offset

    def final_norm_eps(self, model: torch.nn.Module) -> float:
        """The final RMSNorm's epsilon (``variance_epsilon`` on Llama-style norms, ``eps`` on Gemma)."""
        norm = _get(model, self.paths["final_norm"])
        return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))

    @property
    def has_post_norms(self) -> bool:
        """True for sandwich-norm architectures (Gemma-2/3) whose sublayer outputs are normed
        before the residual addition."""
        return self.paths["post_attn_norm"] is not None
