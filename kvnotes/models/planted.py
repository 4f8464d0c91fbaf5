"""Planted-mechanism models: small decoders whose weights are set by hand, so where the model writes
its field-conditioned conclusion, which heads write and read it, and how much of the decision reads
the field directly are known by construction (issue #36). Interpretability methods are validated
on models with planted ground truth (Tracr-compiled transformers; InterpBench's semi-synthetic
models); these are the probes' ground truth.

**The construction** (a ``LlamaForCausalLM``; six layers of four 16-dim heads, MLPs zero; layers 2-5 are empty, so the
probes' default layer bands apply).
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
                        **{f"distract_{v}": 32 + i for i, v in enumerate(VALUES)}}
#: The constant component's size (the others are 0 or 1).
CONST = 32.0
#: Attention logit (before the 1/sqrt(head_dim) scale) of a matching key; a query's sink gets half.
MATCH = 160.0
#: The unembedding scale: the clean runs' scores are +-BETA nats.
BETA = 8.0
#: Head dimensions that carry content: their rotary frequency is ``1e30 ** (-2 * j / 16)`` (negligible).
Q_MATCH, Q_SINK = 7, 6
ROPE_THETA = 1e30


@dataclass(frozen=True)
class PlantedSpec:
    """One planted model (the ``planted`` mapping of a ``conf/model/planted-*.yaml``).

    Attributes:
        family: one of :data:`FAMILIES`.
        alpha: share of the decision read from the field directly (``notes`` 0, ``direct`` 1).
        weights: the notes read head's weights over :data:`MARKERS` (``distributed``; one marker
            otherwise), normalised to sum 1.
    """

    family: str = "notes"
    alpha: float = 0.0
    weights: tuple[float, ...] = (1.0,)

    @classmethod
    def of(cls, spec) -> "PlantedSpec":
        """From a config mapping, checked.

        Raises:
            KvnotesError: an unknown family, alpha outside [0, 1], or weights that are not positive
                or more than :data:`MARKERS`.
        """
        family = str(spec.get("family", "notes"))
        if family not in FAMILIES:
            raise KvnotesError(f"model.planted.family: must be one of {', '.join(FAMILIES)}, got {family!r}")
        alpha = {"notes": 0.0, "direct": 1.0}.get(family, float(spec.get("alpha", 0.0)))
        if not 0.0 <= alpha <= 1.0:
            raise KvnotesError(f"model.planted.alpha: must be in [0, 1], got {alpha}")
        w = tuple(float(x) for x in (spec.get("weights") or (1.0,))) if family == "distributed" else (1.0,)
        if not w or len(w) > len(MARKERS) or min(w) <= 0:
            raise KvnotesError(f"model.planted.weights: 1 to {len(MARKERS)} positive weights, got {list(w)}")
        return cls(family, alpha, tuple(x / sum(w) for x in w))

    def truth(self) -> dict:
        """The ground truth (``config.json[TRUTH_KEY]``): where the notes are written (token roles:
        marker words with their read weights), the write, read and distractor heads ``(layer,
        head)``, the share ``alpha`` read from the field directly, and the residual directions."""
        markers = MARKERS[: len(self.weights)]
        return {"construction_version": CONSTRUCTION_VERSION, "family": self.family, "alpha": self.alpha,
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


@torch.no_grad()
def build(spec: PlantedSpec):
    """The planted model of ``spec`` (fp32, eval mode) and its tokenizer.

    Returns:
        ``(LlamaForCausalLM, PreTrainedTokenizerFast)``; the model's config carries the ground truth
        under :data:`TRUTH_KEY`.
    """
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
    emb = model.model.embed_tokens.weight
    emb[:, D["const"]] = CONST
    emb[ids["<bos>"], D["bos"]] = 1.0
    emb[ids[DECISION_WORD], D["decision"]] = 1.0
    for v in VALUES:
        emb[ids[v], D["value"]] = 1.0
        emb[ids[v], D[f"value_{v}"]] = 1.0
    for i, m in enumerate(MARKERS):
        emb[ids[m], D[f"marker_{i}"]] = 1.0
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
    # the notes read head: key weights 1 + log(w_i) / MATCH' give attention shares w_i between the markers
    logit = MATCH / math.sqrt(HEAD_DIM)
    attend(1, 0, [("decision", 1.0)], [(f"marker_{i}", 1.0 + math.log(w) / logit) for i, w in enumerate(spec.weights)],
           "note", "out", 1.0 - spec.alpha)
    attend(1, 1, [("decision", 1.0)], [("value", 1.0)], "value", "out", spec.alpha)
    if spec.family == "delimiter":
        attend(1, 2, [("decision", 1.0)], [("value", 1.0)], "value", "distract", 1.0)
    for v in VALUES:
        model.lm_head.weight[ids[v], D[f"out_{v}"]] = BETA
    return model, _tokenizer()


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
