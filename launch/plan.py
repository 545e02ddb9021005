"""``--plan=KIND:N``: print a config's memory plan on N devices of KIND and exit, before JAX starts.

The model's shape comes from the config (``model.vocab_size``, ...), from the checkpoint's
config.json when ``model.hf_path`` is set, or, for a config that names no checkpoint yet
(configs/qwen3_8b.py), from its module-level ``PLAN_SHAPE``: the published config.json
values of the checkpoint its docstring is written for. Exit 0 when every role fits, 2 with
one line naming the largest term otherwise.
"""
from __future__ import annotations

import math
import runpy
import types

from gyre_jax import planner
from gyre_jax.errors import ConfigError


def plan_inputs(config, config_path: str | None):
    """(model, cells, train, scheduler) sections of an RL config, without building the whole RLConfig
    (that checks the sandbox and reads task files, which a plan does not need)."""
    from gyre_jax.model.config import ModelConfig
    from gyre_jax.rl import config as rl_config

    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if d.get("job") != "rl":
        raise ConfigError(f"--plan: config.job={d.get('job')!r}; the memory plan is for RL configs (job 'rl')")
    cells = rl_config._build(rl_config.CellsConfig, d.get("cells", {}), "cells")
    train = rl_config._build(rl_config.TrainConfig, d.get("train", {}), "train")
    scheduler = rl_config._build(rl_config.SchedulerConfig, d.get("scheduler", {}), "scheduler")
    model = dict(d["model"])
    hf_path = model.pop("hf_path", "") or ""
    model = rl_config.drop_random_init_shape(model, hf_path)
    model.pop("hf_export", None)
    model.pop("chat_template_kwargs", None)  # the tokenizer's, not the model's: no bytes to plan
    if hf_path:
        m = rl_config._hf_model_config(hf_path, model, cells)
    elif "vocab_size" in model:
        m = rl_config._build(ModelConfig, model, "model")
    else:
        shape = runpy.run_path(config_path).get("PLAN_SHAPE") if config_path else None
        if not shape:
            raise ConfigError("--plan: config.model.hf_path is empty and the config file has no PLAN_SHAPE: set "
                              "--config.model.hf_path=/path/to/hf/checkpoint")
        pad = math.lcm(cells.train_tensor, cells.serve_tensor)
        m = ModelConfig(**shape, vocab_pad_multiple=pad, **{k: model[k] for k in rl_config.HF_MODEL_OVERRIDES
                                                           if model.get(k) not in (None, "")})
    ev = rl_config._build(rl_config.EvalConfig, d.get("eval", {}), "eval")
    return types.SimpleNamespace(model=m, cells=cells, train=train, scheduler=scheduler, eval=ev)


def run(config, config_path: str | None, target: str) -> None:
    """Print the plan; ConfigError (one line) when a role does not fit."""
    kind, n = planner.parse_target(target)
    p = planner.plan(plan_inputs(config, config_path), kind, n)
    print(p.table(), flush=True)
    p.check()
