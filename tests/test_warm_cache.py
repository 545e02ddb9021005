"""The warm-start cache: keyed by what determines the warm start, whole or absent."""
import dataclasses
import os

import jax
import numpy as np

from gyre_jax.rl import warm_cache
from gyre_jax.rl.config import RLConfig


def _cfg(**over):
    base = RLConfig.from_config({"model": {"vocab_size": 272, "d_model": 16, "n_layers": 1, "n_heads": 2,
                                            "n_kv_heads": 1, "head_dim": 8, "d_ff": 32, "max_seq_len": 256}})
    return dataclasses.replace(base, **over)


def test_the_key_follows_what_shapes_the_warm_start_not_how_rl_runs():
    cfg = _cfg()
    key = warm_cache.cache_key(cfg)
    assert warm_cache.cache_key(_cfg(scheduler=dataclasses.replace(cfg.scheduler, mode="colocate"))) == key
    assert warm_cache.cache_key(_cfg(steps=cfg.steps + 5)) == key
    assert warm_cache.cache_key(_cfg(sft=dataclasses.replace(cfg.sft, cache_dir="/elsewhere"))) == key
    assert warm_cache.cache_key(_cfg(sft=dataclasses.replace(cfg.sft, steps=cfg.sft.steps + 1))) != key
    assert warm_cache.cache_key(_cfg(seed=cfg.seed + 1)) != key
    shared = dataclasses.replace(cfg.sft, seed=cfg.seed)  # a fixed warm-start seed: RL seeds share it
    assert warm_cache.cache_key(_cfg(seed=cfg.seed + 1, sft=shared)) == warm_cache.cache_key(_cfg(sft=shared)) == key
    assert warm_cache.cache_key(_cfg(task=dataclasses.replace(cfg.task, family="tiny_agent", family_options=None))) != key


def test_saved_params_and_history_load_back_exactly(tmp_path):
    params = {"a": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, "b": np.float32(2.5) * np.ones(4, np.float32)}
    template = jax.tree.map(np.zeros_like, params)
    assert warm_cache.load(str(tmp_path), "k", template) is None
    warm_cache.save(str(tmp_path), "k", params, [{"loss": 1.0}])
    got, history = warm_cache.load(str(tmp_path), "k", template)
    assert history == [{"loss": 1.0}]
    jax.tree.map(np.testing.assert_array_equal, got, params)
    warm_cache.save(str(tmp_path), "k", template, [])  # an entry is never replaced
    np.testing.assert_array_equal(warm_cache.load(str(tmp_path), "k", template)[0]["a"]["w"], params["a"]["w"])
    assert sorted(os.listdir(tmp_path)) == ["k"]  # no temp directory left behind
