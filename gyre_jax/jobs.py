"""Jobs the launcher can run, by name (``config.job``).

Imported lazily so a simulation never imports the model, the RL loop or jetstream
(launch/main.py still starts JAX, about a second, to log the devices).
"""
import importlib
from typing import Any, Callable

# name -> "module:function"; each function takes (config: ConfigDict, workdir: str).
_JOBS = {
    "rl": "gyre_jax.rl.loop:run",  # the RL loop (configs/demo.py)
    "train_synthetic": "gyre_jax.synthetic_train:run",  # supervised training on synthetic trees (configs/synthetic_train.py)
    "pods_dp": "gyre_jax.pods.dp_job:run",  # elastic steps with satellites in other processes (configs/pods_dp.py)
    "simulate": "gyre_jax.scheduler.cli:run",
    "serve": "gyre_jax.serving.serve_job:run",  # the model behind the recording proxy (configs/serve.py)
    "report": "gyre_jax.report.job:run",  # a run's HTML report from its workdir (--config.job=report, any RL config)
}


def get(name: str) -> Callable[[Any, str], Any]:
    try:
        target = _JOBS[name]
    except KeyError:
        raise LookupError(f"unknown job {name!r}; known jobs: {sorted(_JOBS)}") from None
    module, fn = target.split(":")
    return getattr(importlib.import_module(module), fn)
