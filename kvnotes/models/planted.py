"""Planted-mechanism models: small decoders whose weights are set by hand, so where the model writes
its field-conditioned conclusion, which heads write and read it, and how much of the decision reads
the field directly are known by construction (issue #36). Interpretability methods are validated
on models with planted ground truth (Tracr-compiled transformers; InterpBench's semi-synthetic
models); these are the probes' ground truth.

**The construction** (a ``LlamaForCausalLM``; six layers of four 16-dim heads, MLPs zero; layers 2-5 are empty, so the
probes' default layer bands apply; the same mechanism in ``Gemma3ForCausalLM``, with one KV head per
layer and a sliding-window write layer, is :func:`_build_gemma3`, ``architecture: gemma3``).
A word-level tokenizer knows a few *role words* (every other word is ``<unk>``): the field's values
(:data:`VALUES`), the note markers (:data:`MARKERS`) and the decision word ``answer``, which ends
the answer prefix. The residual stream has named directions (:data:`DIMS`): a constant component
``const`` in every token (32 times the others, so RMSNorm scales all positions alike and the
network is linear in the features to 0.1%), role flags (``bos``, ``value``, ``marker_i``,
``decision``), a one-hot per value (``value_<v>``), the notes ``note_<v>``, the output
``out_<v>`` and a distractor ``distract_<v>``. Queries and keys use only the rotary dimensions of
negligible frequency (``rope_theta = 1e30``, dims 6 and 7 of each head), so attention is by content,
position-independent; every query that has nothing to read attends to ``<bos>``, whose value is 0.

- layer 0, head 0 (**write head**): each marker reads the value token (the field) and writes its
  one-hot into ``note_<v>``;
- layer 1, head 0 (**notes read head**): the decision reads the markers (with the family's
  weights) and copies ``note_<v>`` into ``out_<v>``, scaled by ``1 - alpha``;
- layer 1, head 1 (**direct read head**): the decision reads the field and copies ``value_<v>`` into
  ``out_<v>``, scaled by ``alpha``;
- layer 1, head 2 (**distractor**, ``delimiter`` family): the decision reads the field too but writes
  into ``distract_<v>``, which nothing reads;
- the unembedding row of each value word is ``beta * out_<v>``; every other row is 0.

The decision's score between two values is then ``beta * ((1 - alpha) * (note_new - note_old) +
alpha * (value_new - value_old))`` read at the decision: patching the field's K/V recovers
``alpha`` of it, the markers' K/V ``1 - alpha`` (split by the marker weights).

**Families** (:data:`FAMILIES`): ``notes`` (alpha 0, one marker right after the field), ``direct``
(alpha 1), ``mixed`` (alpha from the config), ``distributed`` (notes on ``k`` markers read with
the given weights), ``delimiter`` (one marker several tokens after the field, and the distractor).
Where the markers sit is the scenario's text (``scenarios/planted``); the ground truth is by token
role and lands in the checkpoint's ``config.json`` under :data:`TRUTH_KEY`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvnotes.errors import KvnotesError

#: The key of ``config.json`` that holds the planted ground truth.
TRUTH_KEY = "kvnotes_planted"
#: Bump when the construction changes: the materialised checkpoints are keyed by it.
CONSTRUCTION_VERSION = 1
FAMILIES = ("notes", "direct", "mixed", "distributed", "delimiter")
#: Architectures a planted model is built in: a Llama decoder, or a Gemma-3 text decoder (one KV head
#: per layer, a sliding-window write layer, Gemma's norms and scaled embedding).
ARCHITECTURES = ("llama", "gemma3")
#: Value words (the field's values of the planted scenarios).
VALUES = ("red", "blue", "green", "amber")
#: Marker words, in order: ``note`` for a single marker, ``note``, ``memo``, ``tag`` for distributed notes.
MARKERS = ("note", "memo", "tag")
DECISION_WORD = "answer"
SPECIALS = ("<bos>", "<eos>", "<unk>", "<pad>")

HIDDEN, N_LAYERS, N_HEADS, HEAD_DIM = 64, 6, 4, 16
#: Residual directions (index in the hidden state).
DIMS: dict[str, int] = {"const": 0, "bos": 1, "value": 2, "decision": 3,
                        **{f"marker_{i}": 4 + i for i in range(len(MARKERS))},
                        **{f"value_{v}": 8 + i for i, v in enumerate(VALUES)},
                        **{f"note_{v}": 16 + i for i, v in enumerate(VALUES)},
                        **{f"out_{v}": 24 + i for i, v in enumerate(VALUES)},
                        **{f"distract_{v}": 32 + i for i, v in enumerate(VALUES)},
                        "attn_const": 40}
#: The constant component's size (the others are 0 or 1).
CONST = 32.0
#: Attention logit (before the 1/sqrt(head_dim) scale) of a matching key; a query's sink gets half.
MATCH = 160.0
#: The unembedding scale: the clean runs' scores are +-BETA nats.
BETA = 8.0
#: Head dimensions that carry content: their rotary frequency is ``1e30 ** (-2 * j / 16)`` (negligible).
Q_MATCH, Q_SINK = 7, 6
ROPE_THETA = 1e30
#: Gemma-3 construction: the write layer's sliding window (tokens; a query sees keys less than this far back).
SLIDING_WINDOW = 16
#: Gemma-3 construction: layer types (the write layer slides, the read layer is global).
GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "sliding_attention", "full_attention")


@dataclass(frozen=True)
class PlantedSpec:
    """One planted model (the ``planted`` mapping of a ``conf/model/planted-*.yaml``).

    Attributes:
        family: one of :data:`FAMILIES`.
        alpha: share of the decision read from the field directly (``notes`` 0, ``direct`` 1).
        weights: the notes read head's weights over :data:`MARKERS` (``distributed``; one marker
            otherwise), normalised to sum 1.
        architecture: one of :data:`ARCHITECTURES`.
    """

    family: str = "notes"
    alpha: float = 0.0
    weights: tuple[float, ...] = (1.0,)
    architecture: str = "llama"

    @classmethod
    def of(cls, spec) -> "PlantedSpec":
        """From a config mapping, checked.

        Raises:
            KvnotesError: an unknown family or architecture, alpha outside [0, 1], or weights that
                are not positive or more than :data:`MARKERS`.
        """
        family = str(spec.get("family", "notes"))
        if family not in FAMILIES:
            raise KvnotesError(f"model.planted.family: must be one of {', '.join(FAMILIES)}, got {family!r}")
        arch = str(spec.get("architecture", "llama"))
        if arch not in ARCHITECTURES:
            raise KvnotesError(f"model.planted.architecture: must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
        alpha = {"notes": 0.0, "direct": 1.0}.get(family, float(spec.get("alpha", 0.0)))
        if not 0.0 <= alpha <= 1.0:
            raise KvnotesError(f"model.planted.alpha: must be in [0, 1], got {alpha}")
        w = tuple(float(x) for x in (spec.get("weights") or (1.0,))) if family == "distributed" else (1.0,)
        if not w or len(w) > len(MARKERS) or min(w) <= 0:
            raise KvnotesError(f"model.planted.weights: 1 to {len(MARKERS)} positive weights, got {list(w)}")
        return cls(family, alpha, tuple(x / sum(w) for x in w), arch)

    def truth(self) -> dict:
        """The ground truth (``config.json[TRUTH_KEY]``): where the notes are written (token roles:
        marker words with their read weights), the write, read and distractor heads ``(layer,
        head)`` (query heads; the Gemma-3 construction's layers have one KV head, which every
        query head of the layer reads), the share ``alpha`` read from the field directly, the
        residual directions, and on Gemma-3 the write layer's sliding window (the notes are
        written only where the field is less than ``sliding_window`` tokens back)."""
        markers = MARKERS[: len(self.weights)]
        extra = {"sliding_window": SLIDING_WINDOW, "layer_types": list(GEMMA_LAYER_TYPES),
                 "constant_heads": [[0, 3], [1, 3]]} if self.architecture == "gemma3" else {}
        return extra | {"construction_version": CONSTRUCTION_VERSION, "architecture": self.architecture,
                "family": self.family, "alpha": self.alpha,
                "notes": {"tokens": list(markers), "weights": list(self.weights), "share": 1.0 - self.alpha},
                "field": {"tokens": list(VALUES), "share": self.alpha},
                "write_heads": [[0, 0]], "read_heads": {"notes": [[1, 0]], "field": [[1, 1]]},
                "distractor_heads": [[1, 2]] if self.family == "delimiter" else [],
                "decision_token": DECISION_WORD, "dims": dict(DIMS),
                "value_directions": {"notes": {v: DIMS[f"note_{v}"] for v in VALUES},
                                     "decision": {v: DIMS[f"out_{v}"] for v in VALUES}},
                "beta": BETA}


def vocabulary() -> list[str]:
    """The tokenizer's words, in id order."""
    return [*SPECIALS, *VALUES, *MARKERS, DECISION_WORD]


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tk.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<pad>")


def _head(h: int) -> slice:
    return slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)


def build(spec: PlantedSpec):
    """The planted model of ``spec`` (fp32, eval mode) and its tokenizer.

    Returns:
        ``(LlamaForCausalLM or Gemma3ForCausalLM, PreTrainedTokenizerFast)``; the model's config
        carries the ground truth under :data:`TRUTH_KEY`.
    """
    model = (_build_gemma3 if spec.architecture == "gemma3" else _build_llama)(spec)
    return model, _tokenizer()


def _embed_roles(emb: torch.Tensor, ids: dict[str, int], scale: float = 1.0) -> None:
    """The role words' features in the embedding ``emb`` ``[vocab, HIDDEN]`` (times ``scale``)."""
    D = DIMS
    emb[:, D["const"]] = CONST * scale
    emb[ids["<bos>"], D["bos"]] = scale
    emb[ids[DECISION_WORD], D["decision"]] = scale
    for v in VALUES:
        emb[ids[v], D["value"]] = scale
        emb[ids[v], D[f"value_{v}"]] = scale
    for i, m in enumerate(MARKERS):
        emb[ids[m], D[f"marker_{i}"]] = scale


def _marker_key(w: float) -> float:
    """The notes read head's key weight of a marker read with weight ``w``: ``1 + log(w) / logit``
    (``logit`` a match's attention logit), so the markers' attention shares are the weights."""
    return 1.0 + math.log(w) / (MATCH / math.sqrt(HEAD_DIM))


@torch.no_grad()
def _build_llama(spec: PlantedSpec):
    from transformers import LlamaConfig, LlamaForCausalLM

    words = vocabulary()
    ids = {w: i for i, w in enumerate(words)}
    config = LlamaConfig(vocab_size=len(words), hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=N_LAYERS,
                         num_attention_heads=N_HEADS, num_key_value_heads=N_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=8192, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
                         tie_word_embeddings=False, bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                         pad_token_id=ids["<pad>"], attention_bias=False, mlp_bias=False)
    setattr(config, TRUTH_KEY, spec.truth())
    model = LlamaForCausalLM(config).eval()
    for p in model.parameters():
        p.zero_()
    D = DIMS
    _embed_roles(model.model.embed_tokens.weight, ids)
    gain = CONST / math.sqrt(HIDDEN)          # RMSNorm's scale of a residual dominated by `const`: undone
    for layer in model.model.layers:
        layer.input_layernorm.weight.fill_(gain)
        layer.post_attention_layernorm.weight.fill_(gain)
    model.model.norm.weight.fill_(gain)

    def attend(layer: int, head: int, query: list[tuple[str, float]], key: list[tuple[str, float]],
               reads: str, writes: str, scale: float) -> None:
        """Head ``(layer, head)``: queries from ``query`` features attend to keys with ``key``
        features (logit MATCH * weight) or else to <bos> (MATCH / 2, from the constant); the value
        copies each ``<reads>_<v>`` into ``<writes>_<v>``, times ``scale``."""
        attn = model.model.layers[layer].self_attn
        hs = _head(head)
        q, k = attn.q_proj.weight[hs], attn.k_proj.weight[hs]
        for name, w in query:
            q[Q_MATCH, D[name]] = MATCH * w
        q[Q_SINK, D["const"]] = MATCH / 2 / CONST
        for name, w in key:
            k[Q_MATCH, D[name]] = w
        k[Q_SINK, D["bos"]] = 1.0
        v, o = attn.v_proj.weight[hs], attn.o_proj.weight[:, hs]
        for j, val in enumerate(VALUES):
            v[j, D[f"{reads}_{val}"]] = 1.0
            o[D[f"{writes}_{val}"], j] = scale

    n_markers = len(spec.weights)
    attend(0, 0, [(f"marker_{i}", 1.0) for i in range(n_markers)], [("value", 1.0)], "value", "note", 1.0)
    attend(1, 0, [("decision", 1.0)], [(f"marker_{i}", _marker_key(w)) for i, w in enumerate(spec.weights)],
           "note", "out", 1.0 - spec.alpha)
    attend(1, 1, [("decision", 1.0)], [("value", 1.0)], "value", "out", spec.alpha)
    if spec.family == "delimiter":
        attend(1, 2, [("decision", 1.0)], [("value", 1.0)], "value", "distract", 1.0)
    for v in VALUES:
        model.lm_head.weight[ids[v], D[f"out_{v}"]] = BETA
    return model


#: Gemma-3 construction: head dimensions of the one KV head per layer. Keys: a constant anchor
#: (k_norm then scales every key alike), the sink flag (every token but the field's values), the
#: value flag and the marker flags; queries: their own constant anchor (dims no key uses). Values:
#: the value one-hot, the notes one-hot, and a constant 1.
G_QC, G_KC, G_SINK, G_VALUE, G_MARK = 0, 1, 2, 3, 4
G_V_VALUE, G_V_NOTE, G_V_CONST = 0, 4, 8


@torch.no_grad()
def _build_gemma3(spec: PlantedSpec):
    """The Gemma-3 construction: the Llama one's mechanism in ``Gemma3ForCausalLM``, where it must
    survive what Gemma adds. (1) One KV head per layer: the query heads select by content from one
    shared key (the value flag in one dimension, the markers in others) and read disjoint parts of
    one shared value (value one-hot, notes one-hot) through their own output columns. (2) ``q_norm``
    / ``k_norm`` RMS-normalise every query and key: each carries a large constant in a dimension
    the other side leaves 0, so the normalisation scales all alike and stays linear to 0.1%; the
    norms' gains restore the Llama construction's logits. (3) The post-attention norm normalises
    each layer's attention output: a constant head (head 3) writes ``+CONST`` (layer 0) and
    ``-CONST`` (layer 1) into ``attn_const``, which dominates the output's RMS, so the norm is a
    known scale that its gain undoes (and the residual's ``attn_const`` is 0 again after layer 1).
    (4) The write layer slides (:data:`SLIDING_WINDOW`): a query that has nothing to read cannot
    rely on ``<bos>`` being in its window, so every token but the field's values and the markers
    is a sink (their values are 0). (5) Gemma's embedding scale ``sqrt(HIDDEN)`` and its norms'
    ``1 + w`` gains are undone; both rotary bases are ``ROPE_THETA``, and content uses only head
    dimensions of negligible rotary frequency."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    words = vocabulary()
    ids = {w: i for i, w in enumerate(words)}
    config = Gemma3TextConfig(vocab_size=len(words), hidden_size=HIDDEN, intermediate_size=16,
                              num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS, num_key_value_heads=1,
                              head_dim=HEAD_DIM, max_position_embeddings=8192, rms_norm_eps=1e-6,
                              sliding_window=SLIDING_WINDOW, layer_types=list(GEMMA_LAYER_TYPES),
                              rope_parameters={t: {"rope_type": "default", "rope_theta": ROPE_THETA}
                                               for t in ("full_attention", "sliding_attention")},
                              query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=None,
                              final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh",
                              tie_word_embeddings=False, bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
                              pad_token_id=ids["<pad>"])
    setattr(config, TRUTH_KEY, spec.truth())
    model = Gemma3ForCausalLM(config).eval()
    for p in model.parameters():
        p.zero_()
    D = DIMS
    _embed_roles(model.model.embed_tokens.weight, ids, 1.0 / math.sqrt(HIDDEN))    # Gemma scales by sqrt(HIDDEN)

    def rms(*parts: float, n: int) -> float:
        return math.sqrt(sum(x * x for x in parts) / n)

    base = rms(CONST, n=HIDDEN)                        # the residual's RMS: its constant
    for i, layer in enumerate(model.model.layers):
        layer.input_layernorm.weight.fill_((rms(CONST, CONST, n=HIDDEN) if i == 1 else base) - 1.0)
        layer.post_attention_layernorm.weight.fill_(rms(CONST, n=HIDDEN) - 1.0)   # the attention output's
    model.model.norm.weight.fill_(base - 1.0)
    # the one KV head of layers 0 and 1 (the empty layers 2-5 keep zero weights: their outputs are 0)
    marker_keys = {f"marker_{i}": _marker_key(w) for i, w in enumerate(spec.weights)}
    k_rms = rms(CONST, 1.0, n=HEAD_DIM)
    q_rms = rms(CONST, 0.5, n=HEAD_DIM)
    for layer in (0, 1):
        attn = model.model.layers[layer].self_attn
        k, v = attn.k_proj.weight, attn.v_proj.weight
        k[G_KC, D["const"]] = 1.0
        k[G_SINK, D["const"]], k[G_SINK, D["value"]] = 1.0 / CONST, -1.0       # the field's values are no sinks,
        for i in range(len(MARKERS)):                                               # nor the markers (their notes)
            k[G_SINK, D[f"marker_{i}"]] = -1.0
        k[G_VALUE, D["value"]] = 1.0
        for j, (name, w) in enumerate(marker_keys.items()):
            k[G_MARK + j, D[name]] = w
        for j, val in enumerate(VALUES):
            v[G_V_VALUE + j, D[f"value_{val}"]] = 1.0
            v[G_V_NOTE + j, D[f"note_{val}"]] = 1.0
        v[G_V_CONST, D["const"]] = 1.0 / CONST
        attn.k_norm.weight.fill_(k_rms - 1.0)
        attn.q_norm.weight.fill_(MATCH * q_rms - 1.0)
        attn.q_norm.weight[G_QC] = -1.0                 # the query's anchor: 0 after the norm

    def head(layer: int, h: int, query: list[tuple[int, str, float]], reads: int, writes: str | None,
             scale: float) -> None:
        """Query head ``h`` of ``layer``: its query matches key dimension ``d`` with feature ``name``
        (times ``w``) for each ``(d, name, w)`` of ``query``, else the sinks (half a match); its
        output copies the value's four dimensions from ``reads`` into ``<writes>_<v>``, times ``scale``."""
        attn = model.model.layers[layer].self_attn
        hs = _head(h)
        q, o = attn.q_proj.weight[hs], attn.o_proj.weight[:, hs]
        q[G_QC, D["const"]] = 1.0
        q[G_SINK, D["const"]] = 0.5 / CONST
        for d, name, w in query:
            q[d, D[name]] = w
        if writes is not None:
            for j, val in enumerate(VALUES):
                o[D[f"{writes}_{val}"], reads + j] = scale

    n = len(spec.weights)
    head(0, 0, [(G_VALUE, f"marker_{i}", 1.0) for i in range(n)], G_V_VALUE, "note", 1.0)
    head(1, 0, [(G_MARK + j, "decision", 1.0) for j in range(n)], G_V_NOTE, "out", 1.0 - spec.alpha)
    head(1, 1, [(G_VALUE, "decision", 1.0)], G_V_VALUE, "out", spec.alpha)
    if spec.family == "delimiter":
        head(1, 2, [(G_VALUE, "decision", 1.0)], G_V_VALUE, "distract", 1.0)
    for layer, sign in ((0, 1.0), (1, -1.0)):           # the constant heads
        head(layer, 3, [], G_V_CONST, None, 0.0)
        model.model.layers[layer].self_attn.o_proj.weight[D["attn_const"], 3 * HEAD_DIM + G_V_CONST] = sign * CONST
    for v in VALUES:
        model.lm_head.weight[ids[v], D[f"out_{v}"]] = BETA
    return model


def spec_key(spec: PlantedSpec) -> str:
    """A short digest of a spec and :data:`CONSTRUCTION_VERSION` (the checkpoint's directory name)."""
    text = json.dumps(asdict(spec) | {"v": CONSTRUCTION_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def materialise_planted(spec_cfg, cache_dir: Path) -> Path:
    """The checkpoint directory of a planted model (``config.json`` with the ground truth,
    safetensors weights, tokenizer), built under ``cache_dir/planted/<family>-<key>`` on first use.

    Raises:
        KvnotesError: from :meth:`PlantedSpec.of`.
    """
    spec = PlantedSpec.of(spec_cfg)
    out = Path(cache_dir) / "planted" / f"{spec.family}-{spec_key(spec)}"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    model, tok = build(spec)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if not out.exists():                         # another process may have built it meanwhile
        tmp.replace(out)
    return out
