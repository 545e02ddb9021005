"""Where a fresh run's policy starts: a checkpoint's weights (``config.model.hf_path``) or a random init,
then the supervised warm start on scripted demonstrations (``config.sft``; gyre_jax.rl.sft), cached
across runs that share it (``config.sft.cache_dir``; gyre_jax.rl.warm_cache)."""
from __future__ import annotations

import jax

from gyre_jax.errors import RunFailed
from gyre_jax.model import init_params
from gyre_jax.rl import warm_cache
from gyre_jax.rl.config import RLConfig
from gyre_jax.rl.sft import demo_trees, noisy_tasks, warm_start


def fresh_params(cfg: RLConfig, tok, mesh=None):
    """A new model's params (config.model.hf_path's weights, born on ``mesh``, or a random init), warm-started
    by SFT on scripted demonstrations (config.sft); (params, history)."""
    params = hf_params(cfg, mesh) if cfg.hf_path else init_params(cfg.model, jax.random.key(cfg.warm_seed))
    if cfg.sft.steps == 0:
        return params, []
    key = warm_cache.cache_key(cfg) if cfg.sft.cache_dir else ""
    cached = warm_cache.load(cfg.sft.cache_dir, key, params) if key else None
    if cached is not None:
        return cached
    params, history = _warm_start(cfg, tok, params)
    if key:
        warm_cache.save(cfg.sft.cache_dir, key, params, history)
    return params, history


def _warm_start(cfg: RLConfig, tok, params):
    # Demonstration tasks: a stream the RL run never draws (gyre_jax.agents.task_sources).
    tasks = cfg.task_source.demo_tasks(cfg.sft.demos)
    if cfg.sft.noisy_fraction:  # deliberately wrong answers: headroom for RL (SFTConfig.noisy_fraction)
        tasks, _ = noisy_tasks(tasks, cfg.sft.noisy_fraction, cfg.warm_seed, cfg.sft.noisy_kind)
    examples = demo_trees(tasks, cfg.harness, tok)
    return warm_start(params, cfg.model, examples, steps=cfg.sft.steps, rows=cfg.sft.rows, row_len=cfg.train.row_len,
                      learning_rate=cfg.sft.learning_rate, seed=cfg.warm_seed, progress=cfg.progress)


def hf_params(cfg: RLConfig, mesh):
    from gyre_jax.model.hf import load_pretrained

    mc = cfg.model
    loaded, params = load_pretrained(cfg.hf_path, mesh=mesh, dtype=mc.param_dtype,
                                     vocab_pad_multiple=mc.vocab_pad_multiple, max_seq_len=mc.max_seq_len)
    if loaded.replace(remat=mc.remat, dtype=mc.dtype, logits_temperature=mc.logits_temperature) != mc:
        raise RunFailed(f"{cfg.hf_path} changed since the config was read: {loaded} != {mc}")
    return params
