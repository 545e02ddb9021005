"""LoRA adapters as PEFT writes and reads them: ``adapter_config.json`` + ``adapter_model.safetensors``.

    save_peft(config, adapter, "/out/adapter", base_model="/ckpt/Qwen3-8B")   # peft and vLLM load it
    lora_cfg, adapter = load_peft("/out/adapter", config)                     # continue training

PEFT's layout (what ``PeftModel.save_pretrained`` writes for a causal LM): one tensor pair per
adapted ``nn.Linear`` (in HF's ``[out, in]`` convention), named
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ([r, in]) and
``...lora_B.weight`` ([out, r]); the update is ``(lora_alpha / r) * B @ A`` (``alpha / sqrt(r)``
with ``use_rslora``). Ours is ``x @ A @ B`` with A [*in, r] and B [r, *out] (model/lora.py), so
a tensor moves by a reshape and a transpose, exact both ways. A layer outside
``LoraConfig.layers`` is written nowhere (``layers_to_transform`` lists the others).

Not covered, each refused with a ValueError naming it: adapters on MoE experts (transformers 5
fuses a Qwen3-MoE layer's experts into ``gate_up_proj``/``down_proj`` parameters, which PEFT
adapts as one matrix per expert through ``target_parameters``, not as our separate gate and up
adapters); PEFT features we do not train (DoRA, bias adapters, ``modules_to_save``, per-module
rank or alpha patterns, regex ``target_modules``).
"""
from __future__ import annotations

import json
import math
import os

import jax
import numpy as np

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.hf.st_io import SafetensorsReader, write_safetensors
from gyre_jax.model.lora import TARGETS, LoraConfig, init_adapter

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers.{i}."
_HF_MODULE = {("attn", "q"): "self_attn.q_proj", ("attn", "k"): "self_attn.k_proj", ("attn", "v"): "self_attn.v_proj",
              ("attn", "o"): "self_attn.o_proj", ("mlp", "gate"): "mlp.gate_proj", ("mlp", "up"): "mlp.up_proj",
              ("mlp", "down"): "mlp.down_proj"}


def _check_exportable(config: ModelConfig) -> LoraConfig:
    lora = config.lora
    if lora is None:
        raise ValueError("PEFT: the model config has no lora")
    if config.num_moe_layers and lora.modules & {"gate", "up", "down"}:
        raise ValueError("PEFT: adapters on MoE experts are not covered (transformers fuses a Qwen3-MoE layer's "
                         "experts into gate_up_proj/down_proj parameters; PEFT adapts those through "
                         "target_parameters, not as per-expert gate_proj/up_proj/down_proj modules): train the "
                         "attention projections only (targets q_proj,k_proj,v_proj,o_proj) to export")
    return lora


def _projections(config: ModelConfig):
    """(stack, module, name, HF layer index, slot in the stack) of every adapted projection of every selected layer."""
    lora = _check_exportable(config)
    chosen = set(lora.layers) if lora.layers else set(range(config.n_layers))
    for stack, start, stop, is_moe in config.layer_runs():
        for slot, i in enumerate(range(start, stop)):
            if i not in chosen:
                continue
            for (mod, name) in _HF_MODULE:
                if name in lora.modules and (mod == "attn" or not is_moe):
                    yield stack, mod, name, i, slot


def peft_config(config: ModelConfig, *, base_model: str = "") -> dict:
    """adapter_config.json's fields for ``config.lora``."""
    lora = _check_exportable(config)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": lora.rslora,
        "target_modules": sorted(lora.targets), "layers_to_transform": list(lora.layers) or None,
        "layers_pattern": "layers" if lora.layers else None, "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        "use_dora": False, "inference_mode": True,
    }


def save_peft(config: ModelConfig, adapter, path: str, *, base_model: str = "", dtype=np.float32) -> str:
    """Write one adapter (``{"lora": ...}``, model/lora.py) as a PEFT adapter directory; returns ``path``."""
    cfg_json = peft_config(config, base_model=base_model)
    host = jax.device_get(adapter)["lora"]
    names, arrays = [], []
    for stack, mod, name, i, slot in _projections(config):
        a = np.asarray(host[stack][mod][f"{name}_lora_a"][slot], np.float32)  # [*in, r]
        b = np.asarray(host[stack][mod][f"{name}_lora_b"][slot], np.float32)  # [r, *out]
        r = a.shape[-1]
        key = PREFIX.format(i=i) + _HF_MODULE[mod, name]
        names += [key + ".lora_A.weight", key + ".lora_B.weight"]
        arrays += [a.reshape(-1, r).T.astype(dtype), b.reshape(r, -1).T.astype(dtype)]
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, WEIGHTS_FILE), [(n, a.shape, a.dtype) for n, a in zip(names, arrays)],
                      iter(arrays))
    tmp = os.path.join(path, CONFIG_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(cfg_json, f, indent=2)
    os.replace(tmp, os.path.join(path, CONFIG_FILE))
    return path


def read_peft_config(path: str) -> LoraConfig:
    """The LoraConfig an adapter directory describes; ValueError naming the file and field it cannot take."""
    where = os.path.join(path, CONFIG_FILE)
    try:
        with open(where) as f:
            c = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: cannot read a PEFT adapter config ({e})") from None
    if c.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type={c.get('peft_type')!r}; only LORA adapters are covered")
    for field, ok in (("use_dora", False), ("bias", "none"), ("modules_to_save", None), ("fan_in_fan_out", False)):
        if c.get(field, ok) not in (ok, [], {}):
            raise ValueError(f"{where}: {field}={c.get(field)!r} is not covered (we train plain LoRA: {field}={ok!r})")
    for field in ("rank_pattern", "alpha_pattern"):
        if c.get(field):
            raise ValueError(f"{where}: {field} is not covered (one rank and alpha for every module)")
    targets = c.get("target_modules")
    if isinstance(targets, str):
        if targets != "all-linear":
            raise ValueError(f"{where}: target_modules={targets!r} is a regex; give a list of module names from {TARGETS}")
        targets = list(TARGETS)
    bad = sorted(set(targets or ()) - set(TARGETS))
    if not targets or bad:
        raise ValueError(f"{where}: target_modules {bad or targets!r} are not among the projections we adapt {TARGETS}")
    layers = c.get("layers_to_transform")
    layers = () if layers is None else (layers,) if isinstance(layers, int) else tuple(layers)
    try:
        return LoraConfig(rank=int(c["r"]), alpha=float(c["lora_alpha"]), dropout=float(c.get("lora_dropout", 0.0)),
                          targets=tuple(t for t in TARGETS if t in targets), layers=layers,
                          rslora=bool(c.get("use_rslora", False)))
    except (KeyError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def load_peft(path: str, config: ModelConfig):
    """(LoraConfig, adapter ``{"lora": ...}``) of the adapter directory ``path`` for base model ``config``.

    ``config.lora`` (if set) must describe the same adapter (rank, targets, layers, scale): training
    goes on with the function the file defines. Every tensor must be there with its shape."""
    lora = read_peft_config(path)
    if config.lora is not None:
        mine, theirs = config.lora, lora
        diff = [f"{k}: run {getattr(mine, k)!r} vs file {getattr(theirs, k)!r}"
                for k in ("rank", "targets", "layers") if getattr(mine, k) != getattr(theirs, k)]
        if not math.isclose(mine.scale, theirs.scale):
            diff.append(f"scale (alpha / rank): run {mine.scale} vs file {theirs.scale}")
        if diff:
            raise ValueError(f"{path}: the adapter differs from config.train.lora: {'; '.join(diff)}")
        lora = mine
    cfg = config.replace(lora=lora)
    _check_exportable(cfg)
    host = jax.tree.map(np.zeros_like, jax.device_get(init_adapter(cfg, jax.random.key(0))))  # layers left out: 0
    where = os.path.join(path, WEIGHTS_FILE)
    with SafetensorsReader(where) as rd:
        for stack, mod, name, i, slot in _projections(cfg):
            a = host["lora"][stack][mod][f"{name}_lora_a"]
            b = host["lora"][stack][mod][f"{name}_lora_b"]
            key = PREFIX.format(i=i) + _HF_MODULE[mod, name]
            want = {key + ".lora_A.weight": (lora.rank, math.prod(a.shape[1:-1])),
                    key + ".lora_B.weight": (math.prod(b.shape[2:]), lora.rank)}
            for k, shape in want.items():
                if k not in rd.tensors:
                    raise ValueError(f"{where}: tensor {k} is missing")
                if rd.shape(k) != shape:
                    raise ValueError(f"{where}: tensor {k} has shape {rd.shape(k)}, the model needs {shape}")
            a[slot] = rd.read(key + ".lora_A.weight").astype(np.float32).T.reshape(a.shape[1:])
            b[slot] = rd.read(key + ".lora_B.weight").astype(np.float32).T.reshape(b.shape[1:])
        known = {PREFIX.format(i=i) + _HF_MODULE[mod, name] + f".lora_{x}.weight"
                 for _, mod, name, i, _ in _projections(cfg) for x in "AB"}
        extra = sorted(set(rd.tensors) - known)
        if extra:
            raise ValueError(f"{where}: tensors the config does not describe, e.g. {extra[:3]}")
    return lora, host

