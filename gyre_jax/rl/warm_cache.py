"""A cache of supervised warm starts, keyed by everything that determines them.

Comparing modes (``tools/bench_learning.py``) or sweeping RL knobs reruns the same warm start
each time: minutes of SFT per run on CPU, and on a cluster the same for every ablation. With
``--config.sft.cache_dir=D`` the first run saves the warm-started params (and the SFT history)
under ``D/<key>/`` and every later run whose key matches loads them instead. The key hashes
the model, the SFT section, the task section, the harness knobs that shape demonstrations,
the seed and the checkpoint path: any change that could change the params is a new key, and
a cached entry is never updated in place (written to a temp name, then renamed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile

import flax.serialization
import jax
import numpy as np

log = logging.getLogger(__name__)
_PARAMS, _META = "params.msgpack", "meta.json"


def cache_key(cfg) -> str:
    """A stable hash of what determines ``cfg``'s warm start (an ``RLConfig``)."""
    parts = {"model": dataclasses.asdict(cfg.model), "sft": dataclasses.asdict(cfg.sft),
             "task": dataclasses.asdict(cfg.task),
             "harness": {f.name: getattr(cfg.harness, f.name) for f in dataclasses.fields(cfg.harness)},
             "row_len": cfg.train.row_len, "seed": cfg.warm_seed, "hf_path": cfg.hf_path}
    parts["sft"].pop("cache_dir", None)
    parts["sft"].pop("seed", None)  # warm_seed above
    parts["harness"] = {k: v for k, v in parts["harness"].items() if k not in (
        "deadline_s", "request_timeout_s", "max_retries", "backoff_base_s", "grader_timeout_s", "sandbox",
        "kind_options", "max_tokens", "temperature", "base_url", "run_id", "concurrency", "grader_concurrency")}
    # ^ how rollouts run and sample (and the runner's own values), not what a demonstration holds
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load(cache_dir: str, key: str, template):
    """(params, history) cached under ``key``, shaped like ``template``; None if absent."""
    path = os.path.join(cache_dir, key)
    if not os.path.isfile(os.path.join(path, _META)):
        return None
    with open(os.path.join(path, _PARAMS), "rb") as f:
        host = flax.serialization.from_bytes(jax.device_get(template), f.read())
    with open(os.path.join(path, _META)) as f:
        history = json.load(f)["history"]
    log.info("sft: warm start loaded from the cache %s", path)
    return jax.tree.map(np.asarray, host), history


def save(cache_dir: str, key: str, params, history: list[dict]) -> None:
    path = os.path.join(cache_dir, key)
    if os.path.isfile(os.path.join(path, _META)):
        return
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=cache_dir)
    with open(os.path.join(tmp, _PARAMS), "wb") as f:
        f.write(flax.serialization.to_bytes(jax.device_get(params)))
    with open(os.path.join(tmp, _META), "w") as f:  # written last: its presence means the entry is whole
        json.dump({"key": key, "history": history}, f)
    try:
        os.rename(tmp, path)
    except OSError:  # another run saved the same key first; theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
        log.info("sft: warm start %s already cached by another run", key)
    else:
        log.info("sft: warm start saved to the cache %s", path)
