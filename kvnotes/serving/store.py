"""The chunk store behind kvnotes' vLLM KV connector (:mod:`kvnotes.serving.connector`), and the
plans a request names to be served from it. Imports no engine: the client, the connector and the
tests share it.

An *entry* is a run of tokens with its K/V, registered once by a client: a stored prompt or prefix
(exact: a full prefill), a precompiled chunk (prefilled in isolation behind a sink,
:func:`kvnotes.ops.chunk.precompile`), or a refreshed field (the new value's tokens prefilled over the
stored prompt's prefix, the paper's in-place edit). Each is one safetensors file: ``keys`` and
``values`` ``[layers, kv_heads, n, head_dim]`` (post-RoPE keys, the model's dtype) and, in its
metadata, the token ids and the position of its first token when it was computed.

A *plan* is what a request asks for: the K/V of its leading tokens as a list of *segments*
``(entry, begin, end)``, concatenated; each segment's keys are re-positioned by RoPE from where they
were computed to where they stand in the prompt (:mod:`kvnotes.kv.rope`, per layer type). The engine
computes the rest of the prompt. Two paths are plans (paper "Models Take Notes at Prefill",
§composition and §editing):

- ``composed``: a stored prefix, then precompiled chunks at new positions;
- ``edited``: a stored prompt's K/V with its field's K/V replaced by the refreshed field's (the rest
  stale; moved when the new value has another token length).

A plan's K/V are approximate, so they must never become the engine's exact prefix-cache state: a
request with a plan carries the plan's own ``cache_salt`` (:func:`plan_request`), which vLLM mixes
into every block hash of the request; exact requests (no salt) cannot hit those blocks, and
requests with the same plan share them (the same approximate K/V). The connector refuses a plan
without its salt (the request is then served by a full prefill and labelled so).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvnotes.errors import KvnotesError

#: Key of kvnotes' plan inside a request's ``kv_transfer_params`` (vLLM ``SamplingParams.extra_args``).
PARAMS_KEY = "kvnotes"
#: The approximate paths a plan can take.
PLAN_PATHS = ("composed", "edited")
#: Key of a capture request inside ``kv_transfer_params`` (:func:`capture_request`).
CAPTURE_KEY = "kvnotes_capture"
#: Every provenance label a served request can carry (``kv_transfer_params["kvnotes_path"]`` of its
#: output): ``prefix_hit`` (vLLM's own exact prefix cache supplied leading blocks), ``composed``,
#: ``edited``, ``full_prefill`` (nothing reused, or a plan refused: ``kvnotes_refused`` says why).
PATHS = ("prefix_hit", *PLAN_PATHS, "full_prefill")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Segment:
    """Tokens ``begin .. end - 1`` of a store entry (indices into the entry's own tokens)."""

    entry: str
    begin: int
    end: int

    def __len__(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class EntryMeta:
    """An entry's token ids and the position its first token had when its K/V were computed."""

    ids: tuple[int, ...]
    start: int


@dataclass(frozen=True)
class Plan:
    """A validated plan: its path, segments, the number of leading prompt tokens they cover."""

    path: str
    segments: tuple[Segment, ...]
    n_tokens: int


class ChunkStore:
    """A directory of entries; metadata and tensors are memoised per file version.

    Args:
        root: the directory (created by :meth:`put`).
        max_cached: entries whose tensors stay in memory (least recently used dropped).
    """

    def __init__(self, root: str | Path, max_cached: int = 64):
        self.root = Path(root)
        self.max_cached = max_cached
        self._meta: dict[str, tuple[tuple, EntryMeta]] = {}
        self._tensors: OrderedDict[str, tuple[tuple, torch.Tensor, torch.Tensor]] = OrderedDict()

    def path(self, name: str) -> Path:
        """The entry's file.

        Raises:
            KvnotesError: a name that is not ``[A-Za-z0-9._-]`` (at most 128 characters, not
                starting with a dot or dash).
        """
        if not _NAME.match(name):
            raise KvnotesError(f"bad store entry name {name!r} (letters, digits, '.', '_', '-'; at most 128)")
        return self.root / f"{name}.safetensors"

    def put(self, name: str, ids: Sequence[int], keys, values, start: int) -> Path:
        """Register an entry (replacing one of the same name), written atomically.

        Args:
            ids: its ``n`` token ids.
            keys: ``[layers, kv_heads, n, head_dim]``, or per layer ``[kv_heads, n, head_dim]`` /
                ``[1, kv_heads, n, head_dim]`` (a transformers cache layer's tensors).
            values: as ``keys``.
            start: position of its first token when the K/V were computed.

        Raises:
            KvnotesError: a bad name, or tensors whose token axis is not ``n`` long.
        """
        from safetensors.torch import save_file

        k, v = _stacked(keys), _stacked(values)
        ids = [int(i) for i in ids]
        if k.shape[2] != len(ids) or v.shape[2] != len(ids) or k.shape[:2] != v.shape[:2]:
            raise KvnotesError(f"store entry {name!r}: {len(ids)} ids but keys {tuple(k.shape)}, values "
                               f"{tuple(v.shape)} (need [layers, kv_heads, n, head_dim])")
        path = self.path(name)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"keys": k.contiguous().cpu(), "values": v.contiguous().cpu()}, str(tmp),
                  metadata={"ids": json.dumps(ids), "start": str(int(start))})
        os.replace(tmp, path)
        return path

    def _version(self, name: str) -> tuple | None:
        try:
            st = self.path(name).stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def meta(self, name: str) -> EntryMeta | None:
        """The entry's ids and start, or None when there is no such entry (header read only)."""
        from safetensors import safe_open

        version = self._version(name)
        if version is None:
            return None
        memo = self._meta.get(name)
        if memo and memo[0] == version:
            return memo[1]
        with safe_open(str(self.path(name)), "pt") as f:
            md = f.metadata()
        meta = EntryMeta(tuple(json.loads(md["ids"])), int(md["start"]))
        self._meta[name] = (version, meta)
        return meta

    def tensors(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The entry's ``(keys, values)``, ``[layers, kv_heads, n, head_dim]`` each.

        Raises:
            KvnotesError: no such entry.
        """
        from safetensors.torch import load_file

        version = self._version(name)
        if version is None:
            raise KvnotesError(f"no store entry {name!r} under {self.root}")
        memo = self._tensors.get(name)
        if memo and memo[0] == version:
            self._tensors.move_to_end(name)
            return memo[1], memo[2]
        t = {k: v.clone() for k, v in load_file(str(self.path(name))).items()}   # in memory, not paged in on first use
        self._tensors[name] = (version, t["keys"], t["values"])
        while len(self._tensors) > self.max_cached:
            self._tensors.popitem(last=False)
        return t["keys"], t["values"]


    def preload(self) -> int:
        """Read every entry's tensors into memory (``max_cached`` raised to their number); returns how many."""
        names = sorted(p.name[:-len(".safetensors")] for p in self.root.glob("*.safetensors"))
        self.max_cached = max(self.max_cached, len(names))
        for name in names:
            self.tensors(name)
        return len(names)


def _stacked(t) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t.detach()
    return torch.stack([x.detach().reshape(x.shape[-3:]) for x in t])


def plan_spec(path: str, segments: Sequence[Segment]) -> dict:
    """The plan as it travels in ``kv_transfer_params[PARAMS_KEY]``: ``{path, segments: [[entry,
    begin, end], ...]}``."""
    return {"path": path, "segments": [[s.entry, int(s.begin), int(s.end)] for s in segments]}


def plan_salt(spec: dict) -> str:
    """The ``cache_salt`` of a plan: a hash of the spec (same plan, same salt; exact requests have none)."""
    return "kvnotes-" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]


def plan_request(path: str, segments: Sequence[Segment]) -> tuple[dict, str]:
    """What a client attaches to a request served through the connector.

    Returns:
        ``(kv_transfer_params, cache_salt)``: pass the first as ``SamplingParams(extra_args=
        {"kv_transfer_params": ...})`` and the second as the prompt's ``cache_salt``.

    Raises:
        KvnotesError: an unknown path.
    """
    if path not in PLAN_PATHS:
        raise KvnotesError(f"unknown plan path {path!r} (known: {', '.join(PLAN_PATHS)})")
    spec = plan_spec(path, segments)
    return {PARAMS_KEY: spec}, plan_salt(spec)


def capture_request(entry: str, n_tokens: int) -> dict:
    """The ``kv_transfer_params`` of a request whose first ``n_tokens`` prompt tokens' K/V, as the
    engine computes them (or holds them in its exact prefix cache), become the store entry ``entry``
    (start 0) before its response returns: the K/V of an engine pass instead of the harness's. The
    request itself is served as any other; its response says ``kvnotes_capture`` (or
    ``kvnotes_capture_refused`` with the reason)."""
    return {CAPTURE_KEY: {"entry": entry, "tokens": int(n_tokens)}}


def check_plan(store: ChunkStore, spec, prompt_ids: Sequence[int], cache_salt: str | None) -> Plan | str:
    """Validate a request's plan against the store and the prompt.

    The segments must exist, lie inside their entries, and their tokens, concatenated, must be the
    prompt's first tokens; at least one prompt token must be left for the engine (it computes the
    decision position); the request must carry the plan's salt (:func:`plan_salt`).

    Returns:
        the :class:`Plan`, or one line saying why it is refused.
    """
    if not isinstance(spec, dict) or spec.get("path") not in PLAN_PATHS or not isinstance(spec.get("segments"), list):
        return f"malformed plan (need {{path: {'|'.join(PLAN_PATHS)}, segments: [[entry, begin, end], ...]}})"
    segments = []
    for s in spec["segments"]:
        if not (isinstance(s, list | tuple) and len(s) == 3 and isinstance(s[0], str)
                and all(isinstance(x, int) for x in s[1:])):
            return f"malformed segment {s!r} (need [entry, begin, end])"
        segments.append(Segment(s[0], s[1], s[2]))
    if not segments:
        return "a plan with no segments"
    n = 0
    for seg in segments:
        try:
            meta = store.meta(seg.entry)
        except KvnotesError as exc:
            return str(exc)
        if meta is None:
            return f"no store entry {seg.entry!r}"
        if not 0 <= seg.begin < seg.end <= len(meta.ids):
            return f"segment {seg.entry}[{seg.begin}:{seg.end}] outside its {len(meta.ids)} tokens"
        if tuple(prompt_ids[n:n + len(seg)]) != meta.ids[seg.begin:seg.end]:
            return f"segment {seg.entry}[{seg.begin}:{seg.end}] is not the prompt's tokens {n}..{n + len(seg) - 1}"
        n += len(seg)
    if n >= len(prompt_ids):
        return f"the plan covers all {len(prompt_ids)} prompt tokens (the engine must compute at least the last)"
    if cache_salt != plan_salt(spec):
        return "an approximate plan needs its own cache_salt (kvnotes.serving.store.plan_request)"
    return Plan(spec["path"], tuple(segments), n)


class Rotations:
    """The RoPE re-positioning of stored keys, per layer type, from the model's own rotary module
    (:func:`kvnotes.kv.rope.delta_rotations`; memoised per delta).

    Args:
        host: a transformers model, or a :class:`RotaryHost` (the rotary module alone).
    """

    def __init__(self, host):
        from kvnotes.kv.rope import rope_layout

        self.host = host
        self.slot, self.interleaved = rope_layout(host)
        self._memo: dict[int, list] = {}

    @classmethod
    def from_config(cls, config) -> "Rotations":
        """For an engine process, which has the Hugging Face config but no transformers model."""
        return cls(RotaryHost(config))

    def rotations(self, delta: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from kvnotes.kv.rope import delta_rotations

        if delta not in self._memo:
            self._memo[delta] = delta_rotations(self.host, int(delta))
        return self._memo[delta]

    def move(self, keys: torch.Tensor, values: torch.Tensor, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys``/``values`` ``[layers, kv_heads, n, dim]`` moved by ``delta`` positions: the rotary
        slot rotated into a new tensor (:func:`kvnotes.kv.rope.rotate_into`), the other returned as
        given (as both are for ``delta == 0``)."""
        from kvnotes.kv.rope import rotate_into

        if delta == 0:
            return keys, values
        src = keys if self.slot == "keys" else values
        dst = torch.empty_like(src)
        rots = self.rotations(delta)
        groups: dict[int, tuple] = {}             # layers of one type share one rotation: one call each
        for i, (c, s) in enumerate(rots):
            groups.setdefault(id(c), (c, s, []))[2].append(i)
        for c, s, layers in groups.values():
            if len(groups) == 1:
                rotate_into(src, c, s, dst, self.interleaved)
            else:
                idx = torch.tensor(layers)
                dst[idx] = rotate_into(src[idx], c, s, torch.empty_like(src[idx]), self.interleaved)
        return (dst, values) if self.slot == "keys" else (keys, dst)


class RotaryHost(torch.nn.Module):
    """A model's rotary embedding without its weights: the module the config's model class builds,
    instantiated on the CPU at the adapter's ``rotary`` path, so :func:`kvnotes.kv.rope.delta_rotations`
    runs on it as on the loaded model (rope scaling and per-layer-type thetas included)."""

    def __init__(self, config):
        super().__init__()
        from transformers import AutoModelForCausalLM

        from kvnotes.models.adapters import Adapter

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        path = Adapter.for_model(meta).paths["rotary"]
        rotary = meta.get_submodule(path)
        self.config = meta.config
        parent: torch.nn.Module = self
        *owners, leaf = path.split(".")
        for name in owners:
            child = torch.nn.Module()
            parent.add_module(name, child)
            parent = child
        parent.add_module(leaf, type(rotary)(config=rotary.config))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


def pieces(store: ChunkStore, plan: Plan, rotations: Rotations, begin: int, end: int):
    """The K/V of prompt tokens ``begin .. end - 1`` under ``plan``, one piece per segment they
    overlap: each segment's tokens at their prompt positions (keys moved by RoPE from the entry's
    positions; unmoved tensors are views of the store's).

    Args:
        begin: first prompt token, ``0 <= begin <= end``.
        end: one past the last, ``<= plan.n_tokens``.

    Yields:
        ``(lo, hi, keys, values)``: prompt tokens ``lo .. hi - 1``, ``[layers, kv_heads, hi - lo, dim]``.
    """
    at = 0
    for seg in plan.segments:
        lo, hi = max(begin, at), min(end, at + len(seg))
        if lo < hi:
            meta = store.meta(seg.entry)
            k, v = store.tensors(seg.entry)
            a = seg.begin + (lo - at)
            keys, values = rotations.move(k[:, :, a:a + hi - lo], v[:, :, a:a + hi - lo], lo - (meta.start + a))
            yield lo, hi, keys, values
        at += len(seg)


def assemble(store: ChunkStore, plan: Plan, rotations: Rotations, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pieces` concatenated: ``(keys, values)``, ``[layers, kv_heads, end - begin, dim]`` each."""
    got = list(pieces(store, plan, rotations, begin, end))
    return torch.cat([g[2] for g in got], 2), torch.cat([g[3] for g in got], 2)
