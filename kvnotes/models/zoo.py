"""The model zoo as data: ``architecture`` blocks of ``conf/model/*.yaml`` -> transformers configs and
random-weight models.

Every zoo config carries its model's published ``config.json`` values under ``architecture:``
(``class`` = the Hugging Face model class, then the config keys; a multimodal wrapper nests
``text_config`` / ``vision_config``). From that block:

- :func:`architecture_config` builds the ``transformers`` config of the right class (the full-size
  shape, no weights);
- :func:`shrink_config` shrinks depth, width, MLP/expert sizes and vocabulary for a CPU while keeping
  every structural property the harness depends on: the attention-head and KV-head counts (so the
  GQA ratio, including one KV head), ``head_dim``, the layer-type pattern (a window shorter than
  the test prompts), rope type and scaling per layer type, MoE routing (top-k of several experts),
  q/k norms, soft-caps, tied embeddings and the wrapper class;
- :func:`random_model` instantiates either with random weights (seeded); no shrinking gives the
  full-size shape (GPU timing, ``device="meta"`` for shapes only);
- :func:`signature` names the structural signature: zoo entries that share it share one run of the
  conformance lane (``tests/lanes/test_zoo.py``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvnotes import CONF_DIR
from kvnotes.errors import KvnotesError

#: ``conf/model`` of the checkout.
MODEL_CONF = CONF_DIR / "model"


@dataclass(frozen=True)
class Shrink:
    """How :func:`shrink_config` shrinks a shape for a CPU.

    Attributes:
        hidden_size: residual width (head counts and ``head_dim`` are kept, so attention is
            ``n_heads * head_dim`` wide whatever this is); a config without ``head_dim``, whose
            attention derives it from the width (Qwen2.5-VL), keeps ``n_heads * head_dim``.
        intermediate_size: dense MLP width; ``moe_intermediate_size``: each expert's width.
        n_experts, experts_per_token: MoE routing kept sparse (top-k of several experts).
        layers: decoder depth when the model has one layer type; with a sliding/full pattern the
            depth is one period of the pattern (at least ``layers``), so every layer type occurs.
        window: sliding window (tokens) for layers that slide, shorter than the test prompts.
        vocab_size: vocabulary (None: keep). The conformance lane uses the tokenizer's size; a
            Qwen-VL wrapper's media token ids move inside it (:func:`_remap_media_tokens`).
        vision: shrink a vision tower to one small layer (the text path is what the probes use).
    """

    hidden_size: int = 64
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    n_experts: int = 8
    experts_per_token: int = 2
    layers: int = 4
    window: int = 16
    vocab_size: int | None = None
    vision: bool = True


def zoo_names() -> list[str]:
    """The zoo: every ``conf/model/*.yaml`` (``_``-prefixed bases excluded)."""
    return sorted(p.stem for p in MODEL_CONF.glob("*.yaml") if not p.stem.startswith("_"))


def zoo_config(name: str):
    """The model config ``conf/model/<name>.yaml`` as a ``DictConfig``, its defaults list merged as
    Hydra merges it (entries of the same group, e.g. ``_base``; ``_self_`` where listed, else last).

    Raises:
        KvnotesError: no such zoo entry.
    """
    from omegaconf import OmegaConf

    path = MODEL_CONF / f"{name}.yaml"
    if not path.is_file():
        raise KvnotesError(f"unknown model '{name}' (known: {', '.join(zoo_names())})")
    cfg = OmegaConf.load(path)
    own = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "defaults"])
    defaults = [str(d) for d in cfg.get("defaults", [])]
    if "_self_" not in defaults:
        defaults.append("_self_")
    parts = [own if d == "_self_" else zoo_config(d) for d in defaults if d == "_self_" or (MODEL_CONF / f"{d}.yaml").is_file()]
    return OmegaConf.merge(*parts)


def plain(block: Any) -> dict:
    """A config mapping (``DictConfig`` or dict) as a plain, independent dict (interpolations resolved)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(block, DictConfig):
        return cast(dict, OmegaConf.to_container(block, resolve=True))
    return copy.deepcopy(dict(block))


def architecture_config(model_cfg: Any):
    """The ``transformers`` config of a zoo entry's ``architecture`` block (full size).

    Args:
        model_cfg: a model config mapping (``conf/model/<name>.yaml``) with ``architecture``.

    Returns:
        a ``PretrainedConfig`` of the class registered for ``model_type`` (``Gemma3Config`` with
        nested text/vision configs for the wrapper), ``architectures`` set to ``[class]``.

    Raises:
        KvnotesError: the entry has no ``architecture`` block, or transformers does not know its
            ``model_type``.
    """
    from transformers import AutoConfig

    block = model_cfg.get("architecture") if hasattr(model_cfg, "get") else None
    if not block:
        raise KvnotesError(f"model '{model_cfg.get('name')}' has no architecture block in conf/model "
                           f"(its published config.json values; see docs/design.md, 'Models and adapters')")
    arch = plain(block)
    cls = arch.pop("class")
    model_type = arch.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **arch)
    except ValueError as exc:
        raise KvnotesError(f"model '{model_cfg.get('name')}': transformers has no config for model_type "
                           f"'{model_type}' ({str(exc).splitlines()[0]})") from None
    config.architectures = [cls]
    return config


def _period(types: list[str]) -> int:
    """Length of the repeating unit of a layer-type list (1 when every layer has one type)."""
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p
    return len(types)


def _shrink_text(text, s: Shrink) -> None:
    types = list(getattr(text, "layer_types", None) or [])
    period = _period(types) if types else 1
    n_layers = max(s.layers, period) if period > 1 else s.layers
    n_layers = min(n_layers, text.num_hidden_layers)
    derived = getattr(text, "head_dim", None) is None
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    text.head_dim = head_dim                    # explicit: the width no longer implies it
    # a config without head_dim (Qwen2.5-VL) has attention that derives it from the width: keep that width
    text.hidden_size = text.num_attention_heads * head_dim if derived else s.hidden_size
    text.intermediate_size = s.intermediate_size
    text.num_hidden_layers = n_layers
    if types:
        text.layer_types = types[:n_layers]
    if getattr(text, "sliding_window", None):
        text.sliding_window = min(text.sliding_window, s.window)
    if getattr(text, "max_window_layers", None):
        text.max_window_layers = n_layers
    if getattr(text, "num_experts", None):
        text.num_experts = min(text.num_experts, s.n_experts)
        text.num_experts_per_tok = min(text.num_experts_per_tok, s.experts_per_token, text.num_experts)
        text.moe_intermediate_size = s.moe_intermediate_size
    if s.vocab_size is not None:
        text.vocab_size = s.vocab_size
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(text, key, None)
            ids = value if isinstance(value, list) else [value]
            if any(v is not None and v >= s.vocab_size for v in ids):
                setattr(text, key, None)


#: A Qwen-VL wrapper's special media token ids, moved into a shrunk vocabulary (:func:`_remap_media_tokens`).
MEDIA_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def _remap_media_tokens(config, vocab_size: int) -> None:
    """Move a vision-language wrapper's media token ids (:data:`MEDIA_TOKENS`) that fall past a shrunk
    vocabulary to its last ids (``vocab_size - 1``, ``- 2``, ... in that order), so a prompt with an
    image can be embedded. Only Qwen-VL wrappers (``vision_start_token_id`` set) are touched; the
    tokenizer's own tokens at those ids then read as media tokens (the embedded SmolLM2 tokenizer's
    last ids are rare merges, absent from the shipped prompts)."""
    if getattr(config, "vision_start_token_id", None) is None:
        return
    top = vocab_size
    for key in MEDIA_TOKENS:
        value = getattr(config, key, None)
        if value is not None and value >= vocab_size:
            top -= 1
            setattr(config, key, top)


def shrink_config(config, shrink: Shrink | None = None):
    """A copy of ``config`` shrunk for a CPU (see :class:`Shrink` for what changes and what is kept).

    Returns:
        a new config of the same class; ``config`` is unchanged.
    """
    s = shrink or Shrink()
    out = copy.deepcopy(config)
    text = out.get_text_config(decoder=True)
    _shrink_text(text, s)
    if s.vocab_size is not None:
        _remap_media_tokens(out, s.vocab_size)
    vision = getattr(out, "vision_config", None)
    if vision is not None and s.vision:
        vision.hidden_size, vision.intermediate_size = 32, 64
        vision.num_hidden_layers, vision.num_attention_heads = 1, 2
        vision.patch_size, vision.image_size = 14, 28
        if hasattr(out, "mm_tokens_per_image"):
            out.mm_tokens_per_image = 4
        if hasattr(vision, "depth"):            # Qwen-VL towers: depth/num_heads, merger into the text width
            vision.depth, vision.num_heads, vision.out_hidden_size = 1, 2, text.hidden_size
            for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
                if getattr(vision, key, None):
                    setattr(vision, key, [0])
    return out


def signature(config) -> tuple:
    """The structural signature of a config: what selects a code path in kvnotes, not a size.

    Fields: model class and model types (wrapper vs text model, MoE class), one KV head or several,
    grouped-query attention or not, ``head_dim``, the layer-type pattern (one period), the rope type
    of each layer type, attention and final soft-caps (present or not), MoE routing (experts, top-k)
    and tied embeddings. Sizes (width, depth, head counts at a given grouping, rope base) are not
    in it: zoo entries that differ only in size share one run of the conformance lane."""
    text = config.get_text_config(decoder=True)
    types = list(getattr(text, "layer_types", None) or ["full_attention"])
    rope = getattr(text, "rope_parameters", None) or {}
    per_type = rope if isinstance(rope, dict) and set(rope) & set(types) else {t: rope for t in set(types)}
    n_heads, n_kv = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return (
        tuple(config.architectures or ()), config.model_type, text.model_type,
        "kv=1" if n_kv == 1 else "kv>1", "gqa" if n_heads > n_kv else "mha",
        getattr(text, "head_dim", None) or text.hidden_size // n_heads, tuple(types[: _period(types)]),
        tuple(sorted((t, (p or {}).get("rope_type", "default")) for t, p in per_type.items())),
        getattr(text, "attn_logit_softcapping", None) is not None,
        getattr(text, "final_logit_softcapping", None) is not None,
        bool(getattr(text, "num_experts", None)),
        bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))),
    )


def lane_groups(names: list[str] | None = None) -> dict[str, list[str]]:
    """Zoo entries grouped by :func:`signature` (of the full-size config): ``{representative: [every
    name sharing its signature]}``. The conformance lane runs the representative (the member with
    the fewest attention heads) and names every member."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for name in names or zoo_names():
        config = architecture_config(zoo_config(name))
        heads = config.get_text_config(decoder=True).num_attention_heads
        groups.setdefault(signature(config), []).append((heads, name))
    # the member with the fewest attention heads runs (the cheapest on a CPU)
    return {min(members)[1]: sorted(n for _, n in members) for members in groups.values()}


def random_model(model_cfg: Any, shrink: Shrink | bool | None = True, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 attn_implementation: str | None = None):
    """A model of a zoo entry's architecture with random weights (``torch.manual_seed(seed)``).

    Args:
        model_cfg: a model config with an ``architecture`` block (e.g. :func:`zoo_config`).
        shrink: ``True`` (default :class:`Shrink`), a :class:`Shrink`, or ``False``/``None`` for the
            full-size shape (GPU timing; ``device="meta"`` builds it without memory).
        dtype: parameter dtype.
        device: where the weights are created.
        attn_implementation: ``sdpa`` / ``eager``; default the entry's ``attn_implementation``.

    Returns:
        the ``transformers`` model of the entry's class, in eval mode with gradients off.

    Raises:
        KvnotesError: from :func:`architecture_config`.
    """
    import transformers

    config = architecture_config(model_cfg)
    if shrink:
        config = shrink_config(config, shrink if isinstance(shrink, Shrink) else None)
    attn = attn_implementation or model_cfg.get("attn_implementation") or "sdpa"
    cls = getattr(transformers, config.architectures[0])
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype, attn_implementation=attn)
    return model.eval().requires_grad_(False)
