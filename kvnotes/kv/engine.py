"""Activation intervention engine (docs/design.md §6): read and replace/add activations at
(layer, positions[, heads]) in one batched forward, through nnsight or TransformerLens 4.

Sites (``kind``), all per decoder layer ``layer`` and per token position:

- ``"hook_z"``: per-head attention outputs before the output projection = the ``o_proj`` *input*
  ``[B, T, n_heads * head_dim]`` viewed as ``[B, T, n_heads, head_dim]``; head ``h`` is the
  slice ``[h * head_dim, (h + 1) * head_dim)`` (head-major, as every adapter's o_proj expects).
- ``"attn_out"``: what the attention sublayer *adds to the residual stream*: the ``post_attn_norm``
  output on sandwich-norm architectures (Gemma-2/3), else the ``o_proj`` output. ``[B, T, hidden]``.
- ``"mlp_out"``: what the MLP sublayer adds: the ``post_mlp_norm`` output (Gemma-2/3), else the MLP
  output. ``[B, T, hidden]``.
- ``"resid_post"``: the decoder layer's output (residual stream after the layer). ``[B, T, hidden]``.
- ``"resid_pre"``: the decoder layer's input (residual stream before it; at layer 0 the scaled
  embedding). ``[B, T, hidden]``.

Sites are :class:`kvnotes.kv.sites.Site`, the one site vocabulary: the engine runs the residual
and head-output kinds above; K/V sites (kind ``"kv"``: cached keys and values at positions, per layer
and KV head) are executed in the attention backend (:func:`kvnotes.kv.masks.site_masks`; patches
:mod:`kvnotes.kv.patch`, knockouts :mod:`kvnotes.kv.knockout`) and refused here.

Names are TransformerLens hook names (``blocks.l.attn.hook_z``, ``hook_attn_out``, ``hook_mlp_out``,
``hook_resid_pre``, ``hook_resid_post``). ``resid_pre[l] + attn_out[l] + mlp_out[l] == resid_post[l]``
on every adapter architecture
(tests/circuits/test_components.py).

An :class:`Intervention` writes ``value`` at the absolute positions (``position_ids``) its site names:
``mode="set"`` replaces, ``mode="add"`` adds; an optional bool ``where`` (per variant, position
and, for heads, head) keeps the original activation where false — that is how a batch of
variants patches a different head each in one forward. Captured activations are the values that
flow on *after* any intervention at that site.

A forward may resume on a prefix cache (``cache``, positions ``[0, start)``): inputs are fed at
``position_ids = start ..`` with a full-length attention mask (docs/design.md §4), batch ``V`` =
the largest batch among ids, cache and intervention values (batch-1 pieces broadcast).

Backends: :class:`NNsightEngine` (``nnsight.NNsight`` wrapping the loaded HF model, the default)
and :class:`LensEngine` (``TransformerBridge.boot_transformers(hf_model=...)``); both apply the
same :func:`apply_intervention` to the same tensors, and tests/kv/test_engine.py checks they agree.
"""

from __future__ import annotations

from contextlib import contextmanager

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from einops import rearrange
from transformers import DynamicCache

from kvnotes.kv import cache as kvcache
from kvnotes.kv.sites import ENGINE_KINDS, Site
from kvnotes.models.adapters import Adapter

#: The kinds of site the engine runs (:data:`kvnotes.kv.sites.ENGINE_KINDS`).
KINDS: tuple[str, ...] = ENGINE_KINDS
InterventionMode = Literal["set", "add"]
INTERVENTION_MODES: tuple[str, ...] = get_args(InterventionMode)
# Execution order of the sites inside one decoder layer (nnsight requires in-order access).
_ORDER = {k: i for i, k in enumerate(ENGINE_KINDS)}


@dataclass
class Intervention:
    """Replace or add ``value`` at one site's positions (and heads).

    Attributes:
        site: where: an engine site (:class:`kvnotes.kv.sites.Site`) of one layer whose
            ``positions`` (absolute token positions, the forward's ``position_ids``) lie inside the fed
            span ``[start, start + n)``; a ``hook_z`` site's ``heads`` are the heads ``value``
            covers (None: all).
        value: head sites ``[V|1, P, n_heads, head_dim]`` (``heads`` given: ``[V|1, P, len(heads),
            head_dim]``); other sites ``[V|1, P, hidden]``. Cast to the model's dtype/device by the engine.
        mode: ``"set"`` (replace) or ``"add"``.
        where: optional bool mask, head sites ``[V|1, P, n_sel_heads]``, else ``[V|1, P]``: entries
            that are false keep the original activation.

    Raises:
        ValueError: an unknown mode, a K/V site, or a site without positions.
    """

    site: Site
    value: torch.Tensor
    mode: InterventionMode = "set"
    where: torch.Tensor | None = None

    def __post_init__(self):
        if self.mode not in INTERVENTION_MODES:
            raise ValueError(f"intervention mode must be one of {INTERVENTION_MODES}, got {self.mode!r}")
        if self.site.kind not in ENGINE_KINDS:
            raise ValueError(f"a {self.site.kind!r} site is not an engine site: K/V sites run in the attention "
                             "backend (kvnotes.kv.masks.site_masks)")
        if self.site.positions is None:
            raise ValueError(f"an intervention's site names its positions: {self.site}")

    @property
    def positions(self) -> tuple[int, ...]:
        """The absolute positions written."""
        assert self.site.positions is not None
        return self.site.positions

    @property
    def heads(self) -> tuple[int, ...] | None:
        """A head site's heads (None: all)."""
        return self.site.heads


@dataclass
class EngineOutput:
    """Result of :meth:`Engine.run`.

    Attributes:
        logprobs: fp32 log-softmax ``[V, n_keep, vocab]`` over the last ``n_keep`` fed positions.
        acts: captured activations per :class:`Site` (head sites ``[V, n, n_heads, head_dim]``,
            others ``[V, n, hidden]``), over the fed positions.
        cache: the (extended) cache when ``use_cache``, else None.
    """

    logprobs: torch.Tensor
    acts: dict[Site, torch.Tensor] = field(default_factory=dict)
    cache: DynamicCache | None = None


def apply_intervention(x: torch.Tensor, iv: Intervention, start: int, n_heads: int) -> torch.Tensor:
    """The activation ``x`` with ``iv`` applied (a new tensor; ``x`` is not modified).

    Args:
        x: ``[V, n, hidden]`` activation over fed positions ``start .. start + n - 1`` (for head
            sites the o_proj input, ``hidden = n_heads * head_dim``).
        start: absolute position of ``x[:, 0]``.

    Raises:
        IndexError: a position outside the fed span.
    """
    V, n, width = x.shape
    idx = torch.as_tensor(list(iv.positions), dtype=torch.long, device=x.device) - start
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise IndexError(f"positions {list(iv.positions)} outside fed span [{start}, {start + n})")
    out = x.clone()
    if iv.site.kind == "hook_z":
        hd = width // n_heads
        view = out.view(V, n, n_heads, hd)
        heads = torch.arange(n_heads, device=x.device) if iv.heads is None else \
            torch.as_tensor(list(iv.heads), dtype=torch.long, device=x.device)
        cur = view[:, idx][:, :, heads]                                     # [V, P, H', hd]
        val = iv.value.to(x.dtype).to(x.device)
        new = cur + val if iv.mode == "add" else val.expand_as(cur)
        if iv.where is not None:
            new = torch.where(iv.where.to(x.device)[..., None], new, cur)
        sub = view[:, idx]                                                   # copy [V, P, H, hd]
        sub[:, :, heads] = new
        view[:, idx] = sub
        return out
    cur = out[:, idx]
    val = iv.value.to(x.dtype).to(x.device)
    new = cur + val if iv.mode == "add" else val.expand_as(cur)
    if iv.where is not None:
        new = torch.where(iv.where.to(x.device)[..., None], new, cur)
    out[:, idx] = new
    return out


class Engine(ABC):
    """Common front end of the backends: argument checks, batching, cache and mask handling.

    Subclasses implement :meth:`_forward`.
    """

    backend = "base"

    def __init__(self, model) -> None:
        self.model = model
        self.adapter = Adapter.for_model(model)

    def run(self, ids: torch.Tensor, interventions: Sequence[Intervention] = (), capture: Sequence[Site] = (),
            cache: DynamicCache | None = None, start: int = 0, n_keep: int | None = 1,
            use_cache: bool = False, resume: tuple[int, torch.Tensor] | None = None) -> EngineOutput:
        """One batched forward with interventions and captures.

        Args:
            ids: ``[n]`` or ``[V|1, n]`` token ids fed at positions ``start .. start + n - 1``.
            interventions: applied in the forward, at their sites.
            capture: sites whose activations are returned (kind and layer: every fed position), the
                keys of :attr:`EngineOutput.acts`.
            cache: prefix cache over ``[0, start)`` (batch 1 or ``V``); it is not modified (a view
                is extended). None with ``start == 0``.
            n_keep: logits of the last ``n_keep`` fed positions (None: all).
            use_cache: return the extended cache.
            resume: ``(l, resid_pre)``: the fed positions' residual stream entering layer ``l``
                (``[1 | V, n, hidden]``, e.g. captured from the clean run), so layers below ``l``
                are not run (nnsight ``skip``). Exact when no intervention or capture sits below
                ``l`` and the residual is that of the same inputs; the extended cache then holds
                no fed positions in layers below ``l``. The TransformerLens backend runs every
                layer (same numbers, no saving).

        Returns:
            :class:`EngineOutput`.

        Raises:
            ValueError: ``start > 0`` without a cache, a cache that does not hold ``start``
                positions, a K/V site, a capture that names positions or heads, a site layer out of
                range, or a site below the ``resume`` layer.
        """
        ids = ids.view(1, -1) if ids.dim() == 1 else ids
        if (cache is None) != (start == 0):
            raise ValueError("a prefix cache is needed exactly when start > 0")
        if cache is not None and kvcache.seq_length(cache) != start:
            raise ValueError(f"cache holds {kvcache.seq_length(cache)} positions, start={start}")
        for s in [iv.site for iv in interventions] + list(capture):
            if s.kind not in ENGINE_KINDS:
                raise ValueError(f"a {s.kind!r} site is not an engine site: K/V sites run in the attention backend "
                                 "(kvnotes.kv.masks.site_masks)")
            if s in capture and s != s.at:
                raise ValueError(f"a capture names a kind and a layer (it returns every fed position): {s}")
            if not 0 <= s.layer < self.adapter.n_layers:
                raise ValueError(f"layer {s.layer} out of range [0, {self.adapter.n_layers})")
            if resume is not None and s.layer < resume[0]:
                raise ValueError(f"site {s} lies below the resume layer {resume[0]}")
        V = max([ids.shape[0]] + [iv.value.shape[0] for iv in interventions]
                + [iv.where.shape[0] for iv in interventions if iv.where is not None]
                + ([cache.layers[0].keys.shape[0]] if cache is not None else []))
        device = self.model.device
        ids = ids.to(device).expand(V, -1)
        n = ids.shape[1]
        config = None if isinstance(cache, kvcache.AllSlotCache) else self.model.config
        if cache is not None:
            kv = kvcache.expand_cache(cache, config, V)
        else:
            kv = DynamicCache(config=self.model.config)
        kwargs = dict(input_ids=ids, position_ids=torch.arange(start, start + n, device=device).unsqueeze(0).expand(V, -1),
                      attention_mask=torch.ones(V, start + n, dtype=torch.long, device=device),
                      past_key_values=kv, use_cache=True, logits_to_keep=n_keep or 0)
        with torch.no_grad():
            logits, acts = self._forward(kwargs, list(interventions), list(capture), start,
                                         None if resume is None or resume[0] == 0 else
                                         (resume[0], resume[1].to(device, self.model.dtype).expand(V, n, -1)))
        logits = logits if n_keep is None else logits[:, -n_keep:]
        return EngineOutput(torch.log_softmax(logits.float(), dim=-1), acts, kv if use_cache else None)

    def _schedule(self, interventions, capture):
        """Operations in execution order: ``[(site, [interventions], capture?)]``."""
        at = [iv.site.at for iv in interventions]
        captured = {s.at for s in capture}
        ops = []
        for s in sorted(set(at) | captured, key=lambda s: (s.layer, _ORDER[s.kind])):
            ops.append((s, [iv for iv, a in zip(interventions, at) if a == s], s in captured))
        return ops

    def _shape_capture(self, site: Site, x: torch.Tensor) -> torch.Tensor:
        if site.kind == "hook_z":
            return rearrange(x, "v t (h d) -> v t h d", h=self.adapter.n_heads)
        return x

    @abstractmethod
    def _forward(self, kwargs, interventions, capture, start, resume=None):
        """Run one forward with ``interventions`` applied (layers below ``resume[0]`` skipped, the
        residual ``resume[1]`` ``[V, n, hidden]`` entering layer ``resume[0]``, where the backend
        can); return (logits, captured activations)."""


class NNsightEngine(Engine):
    """Backend on ``nnsight.NNsight`` wrapping the loaded Hugging Face model (no copy).

    Module paths come from the adapter (``adapters.yaml``): head sites are the ``o_proj`` input,
    ``attn``/``mlp`` the ``post_*_norm`` output where the architecture has one, else the
    ``o_proj``/``mlp`` output; ``resid_post``/``resid_pre`` the decoder layer output/input.
    """

    backend = "nnsight"

    def __init__(self, model) -> None:
        super().__init__(model)
        from nnsight import NNsight

        self.nm = NNsight(model)

    def _envoy(self, path: str):
        env = self.nm
        for part in path.split("."):
            env = env[int(part)] if part.isdigit() else getattr(env, part)
        return env

    def _site(self, site: Site):
        """(envoy, 'input' | 'output') of a site."""
        p = self.adapter.paths
        layer = f"{p['layers']}.{site.layer}"
        if site.kind == "resid_pre":
            return self._envoy(layer), "input"
        if site.kind == "resid_post":
            return self._envoy(layer), "output"
        if site.kind == "hook_z":
            return self._envoy(f"{layer}.{p['o_proj']}"), "input"
        if site.kind == "attn_out":
            return self._envoy(f"{layer}.{p['post_attn_norm'] or p['o_proj']}"), "output"
        return self._envoy(f"{layer}.{p['post_mlp_norm'] or p['mlp']}"), "output"

    def _forward(self, kwargs, interventions, capture, start, resume=None):
        ops = [(self._site(s), s, ivs, cap) for s, ivs, cap in self._schedule(interventions, capture)]
        n_heads = self.adapter.n_heads
        saved = {}
        with self.nm.trace(**kwargs):
            if resume is not None:                    # every layer below resume[0] hands on the residual
                for l in range(resume[0]):
                    self._envoy(f"{self.adapter.paths['layers']}.{l}").skip(resume[1])
            for (env, attr), site, ivs, cap in ops:
                x = getattr(env, attr)
                if ivs:
                    for iv in ivs:
                        x = apply_intervention(x, iv, start, n_heads)
                    setattr(env, attr, x)
                if cap:
                    saved[site] = x.save()
            logits = self.nm.output.logits.save()     # after final soft-capping (Gemma-2)
        acts = {s: self._shape_capture(s, v.detach()) for s, v in saved.items()}
        return logits, acts


def stub_tokenizer(vocab_size: int):
    """A word-level tokenizer without BOS over ``vocab_size`` ids, for booting a
    ``TransformerBridge`` on a model whose real tokenizer is not at hand (the engine feeds ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0")),
        unk_token="t0", eos_token="t1", pad_token="t0")
    # TransformerLens re-loads a tokenizer by name unless it already adds BOS.
    tok.init_kwargs["name_or_path"] = "kvnotes-stub"
    tok.init_kwargs["add_bos_token"] = True
    return tok


class LensEngine(Engine):
    """Backend on TransformerLens 4 ``TransformerBridge`` booted around the same loaded HF model
    (``TransformerBridge.boot_transformers(name, hf_model=model)``, raw HF weights, no folding).

    Hook points: ``blocks.{l}.hook_in`` / ``hook_out`` (decoder layer input/output),
    ``blocks.{l}.attn.o.hook_in`` (o_proj input, head sites), ``blocks.{l}.ln1_post.hook_out`` or
    ``attn.o.hook_out`` (attention addition), ``blocks.{l}.ln2_post.hook_out`` or
    ``mlp.hook_out`` (MLP addition).

    Note: booting forces the model's attention implementation to ``eager`` (TransformerLens
    captures attention patterns), which the nnsight backend then shares.

    Raises:
        ValueError: TransformerLens has no adapter for the architecture (its message is kept).
    """

    backend = "transformer_lens"

    def __init__(self, model, tokenizer=None) -> None:
        super().__init__(model)
        from transformer_lens.model_bridge import TransformerBridge

        if not getattr(model.config, "architectures", None):
            model.config.architectures = [type(model).__name__]       # TL picks its adapter by this
        with _no_modality_processor():
            self.bridge = TransformerBridge.boot_transformers(
                model.config.name_or_path or model.config.model_type, hf_model=model, device=model.device,
                dtype=model.dtype, tokenizer=tokenizer or stub_tokenizer(model.config.get_text_config().vocab_size))

    def _hook_name(self, site: Site) -> str:
        b = f"blocks.{site.layer}"
        post = self.adapter.has_post_norms
        return {"resid_pre": f"{b}.hook_in", "resid_post": f"{b}.hook_out", "hook_z": f"{b}.attn.o.hook_in",
                "attn_out": f"{b}.ln1_post.hook_out" if post else f"{b}.attn.o.hook_out",
                "mlp_out": f"{b}.ln2_post.hook_out" if post and self.adapter.paths["post_mlp_norm"] else f"{b}.mlp.hook_out",
                }[site.kind]

    def _forward(self, kwargs, interventions, capture, start, resume=None):
        n_heads = self.adapter.n_heads             # ``resume`` is not used: every layer runs
        saved = {}
        hooks = []
        for site, ivs, cap in self._schedule(interventions, capture):
            def hook(x, hook=None, site=site, ivs=ivs, cap=cap):
                shape = x.shape                       # the bridge may hand o_proj's input per head
                x = x.flatten(2)
                for iv in ivs:
                    x = apply_intervention(x, iv, start, n_heads)
                if cap:
                    saved[site] = x.detach()
                return x.view(shape)
            hooks.append((self._hook_name(site), hook))
        ids = kwargs.pop("input_ids")
        kwargs.pop("use_cache")
        kwargs.pop("logits_to_keep")                  # the bridge returns every position's logits
        logits = self.bridge.run_with_hooks(ids, fwd_hooks=hooks, return_type="logits", prepend_bos=False,
                                            **kwargs)
        return logits, {s: self._shape_capture(s, v) for s, v in saved.items()}


@contextmanager
def _no_modality_processor():
    """Boot the TransformerLens bridge without its image/audio processor: the engine feeds token ids
    only, and for a multimodal wrapper (Gemma-3 4B-27B) TransformerLens 4 would fetch the processor
    from the hub (hanging offline on retries) and, when that fails, ``pip install torchvision``
    into the running environment."""
    from transformer_lens.model_bridge.sources.transformers import source

    saved = source.load_modality_processor
    source.load_modality_processor = lambda *args, **kwargs: None
    try:
        yield
    finally:
        source.load_modality_processor = saved


BACKENDS = {"nnsight": NNsightEngine, "transformer_lens": LensEngine}


def make_engine(model, backend: str = "nnsight") -> Engine:
    """The engine of ``backend`` (``"nnsight"`` default, or ``"transformer_lens"``) for ``model``.

    Raises:
        ValueError: unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown engine backend {backend!r} (known: {sorted(BACKENDS)})")
    return BACKENDS[backend](model)
