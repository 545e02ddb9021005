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
    from gyre_jax.schema import from_mapping

    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if d.get("job") != "rl":
        raise ConfigError(f"--plan: config.job={d.get('job')!r}; the memory plan is for RL configs (job 'rl')")
    base = rl_config.RLConfig.defaults()
    cells, train, scheduler, ev = (from_mapping(type(getattr(base, k)), d.get(k, {}), k, base=getattr(base, k))
                                   for k in ("cells", "train", "scheduler", "eval"))
    model = {k: v for k, v in d["model"].items() if k not in rl_config.MODEL_FLAGS}
    hf_path = d["model"].get("hf_path", "")
    if hf_path:
        m = rl_config._hf_model_config(hf_path, model, cells)
    elif all(model.get(k) is not None for k in rl_config.SHAPE_FIELDS):
        m = from_mapping(ModelConfig, model, "model", base=rl_config.TINY_MODEL)
    else:  # a checkpoint config that names no checkpoint yet
        shape = runpy.run_path(config_path).get("PLAN_SHAPE") if config_path else None
        if not shape:
            raise ConfigError("--plan: config.model.hf_path is empty and the config file has no PLAN_SHAPE: set "
                              "--config.model.hf_path=/path/to/hf/checkpoint")
        pad = math.lcm(cells.train_tensor, cells.serve_tensor)
        given = {k: model[k] for k in rl_config.HF_MODEL_OVERRIDES
                 if model.get(k) is not None and model.get(k) != getattr(rl_config.TINY_MODEL, k)}
        m = ModelConfig(**shape, vocab_pad_multiple=pad, **given)
    return types.SimpleNamespace(model=m, cells=cells, train=train, scheduler=scheduler, eval=ev)


def run(config, config_path: str | None, target: str) -> None:
    """Print the plan; ConfigError (one line) when a role does not fit."""
    kind, n = planner.parse_target(target)
    p = planner.plan(plan_inputs(config, config_path), kind, n)
    print(p.table(), flush=True)
    p.check()
