"""kvnotes' vLLM V1 KV connector: composed chunks and edited fields served inside the engine, each
response labelled with the path that served it. Runs in the serving environment only (it imports vLLM).

Loaded by the engine from its ``kv_transfer_config``::

    KVTransferConfig(kv_connector="KvnotesConnector", kv_role="kv_both",
                     kv_connector_module_path="kvnotes.serving.connector",
                     kv_connector_extra_config={"store": "/path/to/store", "preload": False})

(``preload``: read every entry into the worker's memory when the engine starts; otherwise an entry
is read from disk at its first use and kept, least recently used dropped.)

A request that names a plan (:func:`kvnotes.serving.store.plan_request`: its ``kv_transfer_params``
and ``cache_salt``) gets the K/V of its plan's leading tokens from the store
(:mod:`kvnotes.serving.store`: stored prefixes, precompiled chunks, refreshed fields), each segment
re-positioned by RoPE to where it stands; vLLM computes the rest of the prompt. Every request, with
a plan or not, comes back with ``kv_transfer_params = {"kvnotes_path": label, "kvnotes_loaded":
tokens from the store, "kvnotes_local": tokens from vLLM's own prefix cache}``, the label one of
:data:`kvnotes.serving.store.PATHS`; a refused plan adds ``kvnotes_refused`` (why) and is served by
the engine alone.

A request that asks for a capture (:func:`kvnotes.serving.store.capture_request`) has the K/V of
its first tokens, as the engine computed them, written to the store as a new entry before its
response returns: chunks and stored prompts registered from an engine pass, without the harness's
model (read back from the paged cache in :meth:`save_kv_layer`, written in :meth:`wait_for_save`).

Scheduler side: :meth:`KvnotesConnector.get_num_new_matched_tokens` validates the plan
(:func:`kvnotes.serving.store.check_plan`, which also requires the plan's salt, so approximate blocks
are never exact prefix-cache state) and says how many tokens beyond vLLM's local hit the store
supplies; :meth:`build_connector_meta` hands the worker the blocks to fill. Worker side:
:meth:`start_load_kv` assembles the K/V (:func:`kvnotes.serving.store.assemble`) and writes them into
each attention layer's paged cache before the forward (synchronous load: the whole load runs before
the first layer).

Paged-cache layouts written: vLLM's CPU backend (``[blocks, kv_heads, block_size, 2 * head_dim]``:
each (block, head) holds its keys as ``[head_dim, block_size]``, dimension-major, then its values as
``[block_size, head_dim]``; read off the engine's own writes on vLLM 0.32.0's fp32 ``vec`` kernels,
and checked by the serving tests, whose exact plan must reproduce the full prefill) and the
``[2, blocks, block_size, kv_heads, head_dim]`` layout of the CUDA flash-attention backends; another
layout raises. Not handled: preempted requests resumed with a plan (vLLM recomputes them), MLA
caches, sliding-window layers that drop blocks (a plan's K/V are written for every layer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from kvnotes.errors import KvnotesError
from kvnotes.serving.store import CAPTURE_KEY, PARAMS_KEY, ChunkStore, Plan, Rotations, check_plan, pieces

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class _Load:
    req_id: str
    plan: Plan
    begin: int                     # first token to load (vLLM's local hit ends here)
    end: int                       # one past the last
    block_ids: list[int]


@dataclass
class _Capture:
    entry: str
    ids: list[int]                 # the prompt's first n tokens, whose K/V become the entry
    block_ids: list[int]


@dataclass
class KvnotesConnectorMetadata(KVConnectorMetadata):
    """The loads of one engine step, and the captures that complete in it."""

    loads: list[_Load] = field(default_factory=list)
    captures: list[_Capture] = field(default_factory=list)


class KvnotesConnector(KVConnectorBase_V1):
    """See the module docstring. ``kv_connector_extra_config["store"]``: the store's directory."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        root = self._kv_transfer_config.get_from_extra_config("store", None)
        if not root:
            raise KvnotesError("KvnotesConnector needs kv_connector_extra_config={'store': DIR}")
        self.store = ChunkStore(root)
        self.block_size = vllm_config.cache_config.block_size
        self._hf_config = vllm_config.model_config.hf_config
        self._rotations: Rotations | None = None
        if role == KVConnectorRole.WORKER:          # off every request's path: the rotary module, the entries
            self._rotations = Rotations.from_config(self._hf_config)
            if self._kv_transfer_config.get_from_extra_config("preload", False):
                self.store.preload()
        self._labels: dict[str, dict[str, Any]] = {}         # scheduler: provenance per request
        self._pending: dict[str, tuple[Plan, int]] = {}      # scheduler: plan and local hit
        self._to_load: dict[str, tuple[Plan, int, int]] = {}  # scheduler: allocated, not yet sent
        self._capturing: dict[str, _Capture] = {}            # scheduler: captures until their prefill is done
        self._captured: dict[str, dict[int, tuple]] = {}     # worker: entry -> layer -> (keys, values)

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the store supplies beyond vLLM's local hit (``num_computed_tokens``, block-aligned)."""
        spec = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        label: dict[str, Any] = {"kvnotes_local": int(num_computed_tokens), "kvnotes_loaded": 0}
        self._pending.pop(request.request_id, None)
        self._capture_of(request, label)
        if spec is None:
            label["kvnotes_path"] = "prefix_hit" if num_computed_tokens else "full_prefill"
            self._labels[request.request_id] = label
            return 0, False
        plan = check_plan(self.store, spec, request.prompt_token_ids or [], request.cache_salt)
        if isinstance(plan, str):
            label |= {"kvnotes_path": "full_prefill", "kvnotes_refused": plan}
            if num_computed_tokens:                       # its own salt's blocks only: still exact
                label["kvnotes_path"] = "prefix_hit"
            self._labels[request.request_id] = label
            return 0, False
        n = max(plan.n_tokens - num_computed_tokens, 0)
        label |= {"kvnotes_path": plan.path, "kvnotes_loaded": n, "kvnotes_plan_tokens": plan.n_tokens}
        self._labels[request.request_id] = label
        if n:
            self._pending[request.request_id] = (plan, int(num_computed_tokens))
        return n, False

    def _capture_of(self, request, label: dict[str, Any]) -> None:
        """Note a capture request (``kv_transfer_params[CAPTURE_KEY]``), or say in ``label`` why not."""
        want = (request.kv_transfer_params or {}).get(CAPTURE_KEY)
        if want is None:
            return
        ids = list(request.prompt_token_ids or [])
        n, entry = (want.get("tokens"), want.get("entry")) if isinstance(want, dict) else (None, None)
        try:
            self.store.path(entry if isinstance(entry, str) else "")
        except KvnotesError as exc:
            label["kvnotes_capture_refused"] = str(exc)
            return
        if not isinstance(n, int) or not 0 < n <= len(ids):
            label["kvnotes_capture_refused"] = f"capture of {n!r} tokens from a {len(ids)}-token prompt"
            return
        self._capturing[request.request_id] = _Capture(entry, ids[:n], [])
        label["kvnotes_capture"] = entry

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pending = self._pending.pop(request.request_id, None)
        label = self._labels.get(request.request_id)
        if pending is None or num_external_tokens == 0:
            if label is not None and pending is not None:   # the scheduler kept its local hit instead
                label["kvnotes_loaded"] = 0
            return
        plan, begin = pending
        self._to_load[request.request_id] = (plan, begin, begin + num_external_tokens)
        if label is not None:
            label["kvnotes_loaded"] = int(num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KvnotesConnectorMetadata:
        meta = KvnotesConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            load = self._to_load.pop(new.req_id, None)
            if load is not None:
                plan, begin, end = load
                meta.loads.append(_Load(new.req_id, plan, begin, end, list(new.block_ids[0])))
            if new.req_id in self._capturing:
                self._capturing[new.req_id].block_ids = list(new.block_ids[0])
                self._maybe_capture(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):                 # a chunked prefill's later steps
            cap = self._capturing.get(req_id)
            if cap is None:
                continue
            if cached.new_block_ids[i] is not None:
                resumed = req_id in cached.resumed_req_ids                # then it lists every block
                cap.block_ids = [*([] if resumed else cap.block_ids), *cached.new_block_ids[i][0]]
            self._maybe_capture(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_capture(self, meta: KvnotesConnectorMetadata, req_id: str, computed: int) -> None:
        """Hand the worker a capture once this step computes the last of its tokens."""
        if computed >= len(self._capturing[req_id].ids):
            meta.captures.append(self._capturing.pop(req_id))

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        self._capturing.pop(request.request_id, None)
        return False, self._labels.pop(request.request_id, None)

    # ---------------------------------------------------------------- worker side
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvnotesConnectorMetadata) or not meta.loads:
            return
        layers = []
        for name, layer in forward_context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            m = _LAYER.search(name)
            if isinstance(cache, torch.Tensor) and cache.numel() and m:
                layers.append((int(m.group(1)), cache))
        for load in meta.loads:
            block_ids = torch.tensor(load.block_ids)
            for lo, hi, keys, values in pieces(self.store, load.plan, self._rotations, load.begin, load.end):
                tokens = torch.arange(lo, hi)
                blocks, offsets = block_ids[tokens // self.block_size], tokens % self.block_size
                for index, cache in layers:
                    write_paged(cache, blocks, offsets, keys[index], values[index])

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Read the captured tokens' K/V of this layer (the engine has just written them)."""
        meta = self._get_connector_metadata()
        m = _LAYER.search(layer_name)
        if not isinstance(meta, KvnotesConnectorMetadata) or not meta.captures or m is None:
            return
        for cap in meta.captures:
            tokens = torch.arange(len(cap.ids))
            blocks = torch.tensor(cap.block_ids)[tokens // self.block_size]
            self._captured.setdefault(cap.entry, {})[int(m.group(1))] = read_paged(kv_layer, blocks,
                                                                                  tokens % self.block_size)

    def wait_for_save(self) -> None:
        """Write each completed capture as a store entry (positions ``0 ..``), before the step returns."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvnotesConnectorMetadata):
            return
        for cap in meta.captures:
            layers = self._captured.pop(cap.entry, {})
            if layers:
                order = sorted(layers)
                self.store.put(cap.entry, cap.ids, [layers[i][0] for i in order], [layers[i][1] for i in order], 0)


def _cpu_halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU backend's cache ``[blocks, kv_heads, block_size, 2 * head_dim]`` as its key view
    ``[blocks, kv_heads, head_dim, block_size]`` and value view ``[blocks, kv_heads, block_size, head_dim]``."""
    nb, heads, bs, two_dim = cache.shape
    halves = cache.view(nb, heads, 2, bs * (two_dim // 2))
    return (halves[:, :, 0].view(nb, heads, two_dim // 2, bs),        # keys dimension-major
            halves[:, :, 1].view(nb, heads, bs, two_dim // 2))        # values token-major


def _layout(cache: torch.Tensor, heads: int | None = None, dim: int | None = None) -> str:
    """``"cpu"`` or ``"flash"`` (module docstring), checked against ``heads`` and ``dim`` when given.

    Raises:
        KvnotesError: another layout.
    """
    if cache.dim() == 4 and heads in (None, cache.shape[1]) and dim in (None, cache.shape[3] // 2) \
            and cache.shape[3] % 2 == 0:
        return "cpu"
    if cache.dim() == 5 and cache.shape[0] == 2 and heads in (None, cache.shape[3]) and dim in (None, cache.shape[4]):
        return "flash"
    raise KvnotesError(f"KvnotesConnector cannot address a paged cache of shape {tuple(cache.shape)}"
                       + (f" ({heads} kv heads of {dim})" if heads else ""))


def read_paged(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's ``(keys, values)`` ``[kv_heads, n, head_dim]`` (CPU copies) of the ``n`` tokens at
    (``blocks[i]``, ``offsets[i]``) of a paged cache (layouts: the module docstring).

    Raises:
        KvnotesError: another layout.
    """
    blocks, offsets = blocks.to(cache.device), offsets.to(cache.device)
    if _layout(cache) == "cpu":
        kview, vview = _cpu_halves(cache)
        k, v = kview[blocks, :, :, offsets], vview[blocks, :, offsets]
    else:
        k, v = cache[0, blocks, offsets], cache[1, blocks, offsets]
    return k.transpose(0, 1).cpu().clone(), v.transpose(0, 1).cpu().clone()


def write_paged(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> None:
    """Write one layer's ``keys``/``values`` ``[kv_heads, n, head_dim]`` for ``n`` tokens at
    (``blocks[i]``, ``offsets[i]``) of a paged cache (layouts: the module docstring).

    Raises:
        KvnotesError: another layout.
    """
    heads, _, dim = keys.shape
    k = keys.transpose(0, 1).to(cache.device, cache.dtype)        # [n, heads, dim]
    v = values.transpose(0, 1).to(cache.device, cache.dtype)
    blocks, offsets = blocks.to(cache.device), offsets.to(cache.device)
    if _layout(cache, heads, dim) == "cpu":
        kview, vview = _cpu_halves(cache)
        kview[blocks, :, :, offsets] = k
        vview[blocks, :, offsets] = v
    else:
        cache[0, blocks, offsets] = k
        cache[1, blocks, offsets] = v
