"""Jobs the launcher can run, by name (``config.job``): a ``gyre_jax.registry.Registry`` of lazy entries.

Each entry is ``"module:function"``, imported only when that job runs, so a simulation never
imports the model, the RL loop or jetstream (launch/main.py still starts JAX, about a second,
to log the devices). Each function takes (config: ConfigDict, workdir: str).
"""
from typing import Any, Callable

from gyre_jax.registry import Registry

JOBS = Registry("job", "job")
JOBS.register_lazy("rl", "gyre_jax.rl.loop:run", summary="the RL loop (configs/demo.py)")
JOBS.register_lazy("train_synthetic", "gyre_jax.synthetic_train:run",
                   summary="supervised training on synthetic trees (configs/synthetic_train.py)")
JOBS.register_lazy("pods_dp", "gyre_jax.pods.dp_job:run",
                   summary="elastic steps with satellites in other processes (configs/pods_dp.py)")
JOBS.register_lazy("simulate", "gyre_jax.scheduler.cli:run", summary="the scheduler's simulator (configs/sim_paper.py)")
JOBS.register_lazy("serve", "gyre_jax.serving.serve_job:run",
                   summary="the model behind the recording proxy (configs/serve.py)")
JOBS.register_lazy("report", "gyre_jax.report.job:run",
                   summary="a run's HTML report from its workdir (--config.job=report, any RL config)")


def get(name: str) -> Callable[[Any, str], Any]:
    """The job's function (imported now); an unknown name is a LookupError naming the known jobs."""
    return JOBS.get(name).obj
