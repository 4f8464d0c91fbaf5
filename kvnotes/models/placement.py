"""Where a model's layers go: device maps (accelerate's strategies or an explicit ``{module path:
device}`` map), memory caps, disk offload and bitsandbytes quantization, checked before anything
loads (:func:`placement_kwargs`, :func:`check_device_map`), applied to a model built in memory
(:func:`dispatch_in_memory`) and recorded (:func:`placement_info`). :mod:`kvnotes.models.loading`
uses them for every load.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from kvnotes.errors import KvnotesError

#: Device-map strategies accelerate computes itself (``from_pretrained(device_map=...)``).
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
#: ``model.quantization`` values: bitsandbytes on CUDA.
QUANTIZATIONS = ("nf4", "int8")


def _device_ok(value: Any) -> bool:
    if isinstance(value, int) and value >= 0:
        return True
    return isinstance(value, str) and (value in ("cpu", "disk", "meta", "mps") or value.startswith("cuda"))


def placement_kwargs(cfg: Any, dev: torch.device, dtype: torch.dtype) -> dict:
    """``from_pretrained`` keyword arguments for the model's placement and quantization.

    Args:
        cfg: the model config (``device_map``, ``max_memory``, ``offload_folder``, ``quantization``;
            ``conf/model/_base.yaml``).
        dev: the run's device (:func:`kvnotes.models.loading.resolve_device`). dtype: the compute dtype.

    Returns:
        ``{}`` for a single-device load (the caller moves the model to ``dev``); otherwise
        ``device_map`` (a strategy name or an explicit ``{module path: device}`` map),
        ``max_memory``, ``offload_folder`` and ``quantization_config`` (a
        ``transformers.BitsAndBytesConfig``) as given.

    Raises:
        KvnotesError: an unknown strategy or device in the map; a quantization that is unknown,
            asked for on a device other than CUDA, or without bitsandbytes installed.
    """
    from omegaconf import DictConfig, OmegaConf

    out: dict[str, Any] = {}
    dmap = cfg.get("device_map")
    if isinstance(dmap, DictConfig):
        dmap = OmegaConf.to_container(dmap, resolve=True)
    if dmap is not None:
        if isinstance(dmap, str):
            if dmap not in DEVICE_MAP_STRATEGIES:
                raise KvnotesError(f"model.device_map '{dmap}' is not a strategy ({', '.join(DEVICE_MAP_STRATEGIES)}) "
                                   f"or a {{module path: device}} map")
        elif isinstance(dmap, dict):
            bad = {k: v for k, v in dmap.items() if not _device_ok(v)}
            if bad:
                raise KvnotesError(f"model.device_map: unknown device(s) {bad} (use a GPU index, cuda:N, cpu or disk)")
        else:
            raise KvnotesError(f"model.device_map must be a strategy name or a mapping, got {dmap!r}")
        out["device_map"] = dmap
        mem = cfg.get("max_memory")
        if mem is not None:
            mem = OmegaConf.to_container(mem) if isinstance(mem, DictConfig) else dict(mem)
            out["max_memory"] = {int(k) if str(k).isdigit() else k: v for k, v in mem.items()}
        needs_disk = dmap == "auto" or (isinstance(dmap, dict) and "disk" in dmap.values())
        if needs_disk:
            from kvnotes.models.loading import cache_dir

            out["offload_folder"] = str(cfg.get("offload_folder") or cache_dir() / "offload" / str(cfg.name))
    quant = cfg.get("quantization")
    if quant is not None:
        if quant not in QUANTIZATIONS:
            raise KvnotesError(f"unknown model.quantization '{quant}' (use {', '.join(QUANTIZATIONS)}, or null for "
                               f"the checkpoint as published, e.g. an FP8 checkpoint)")
        if dev.type != "cuda":
            raise KvnotesError(f"model.quantization={quant} runs on CUDA only (bitsandbytes); this run's device is "
                               f"{dev}: drop the quantization or run on a GPU")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise KvnotesError(f"model.quantization={quant} needs bitsandbytes: pip install bitsandbytes")
        from transformers import BitsAndBytesConfig

        out["quantization_config"] = (
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                               bnb_4bit_use_double_quant=True)
            if quant == "nf4" else BitsAndBytesConfig(load_in_8bit=True))
        out.setdefault("device_map", {"": dev.index or 0})
    return out


def check_device_map(model: torch.nn.Module, dmap: Any) -> None:
    """Reject an explicit device map naming a module ``model`` does not have (for a checkpoint,
    ``model`` is a weightless ``meta`` copy of its architecture, checked before anything loads).

    Raises:
        KvnotesError: names the unknown module paths and the model's top-level modules.
    """
    if not isinstance(dmap, dict):
        return
    names = {n for n, _ in model.named_modules()}
    unknown = sorted(k for k in dmap if k and k not in names)
    if unknown:
        top = sorted({n.split(".")[0] for n in names if n})
        raise KvnotesError(f"model.device_map names modules the model does not have: {', '.join(unknown)} "
                           f"(top-level modules: {', '.join(top)}; e.g. model.layers.0)")


def placement_info(model: Any, kwargs: dict) -> dict:
    """Provenance of a load's placement: the device map (module -> device, as accelerate resolved it)
    and the quantization (bitsandbytes request or a pre-quantized checkpoint's method)."""
    dmap = getattr(model, "hf_device_map", None)
    qc = getattr(model.config, "quantization_config", None)
    qdict = qc.to_dict() if hasattr(qc, "to_dict") else qc
    return {"device_map": {k: str(v) for k, v in dmap.items()} if dmap else None,
            "devices": sorted({str(v) for v in dmap.values()}) if dmap else None,
            "max_memory": {str(k): v for k, v in kwargs.get("max_memory", {}).items()} or None,
            "quantization": (qdict or {}).get("quant_method") if isinstance(qdict, dict) else None,
            "quantization_config": qdict if isinstance(qdict, dict) else None}


def dispatch_in_memory(model: Any, placement: dict) -> Any:
    """Place a model built in memory (random weights) with accelerate, as ``from_pretrained`` places
    a checkpoint: a strategy is resolved by ``infer_auto_device_map`` under ``max_memory``."""
    from accelerate import dispatch_model, infer_auto_device_map

    dmap = placement["device_map"]
    check_device_map(model, dmap)
    if isinstance(dmap, str):
        dmap = infer_auto_device_map(model, max_memory=placement.get("max_memory"),
                                     no_split_module_classes=model._no_split_modules)
    model = dispatch_model(model, device_map=dmap, offload_dir=placement.get("offload_folder"))
    model.hf_device_map = dmap
    return model
