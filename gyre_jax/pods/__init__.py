"""gyre_jax.pods: cells in separate processes, on JAX's own distributed runtime.

One process per cell (or per host of a cell), all started by the same
``python -m launch.main --config ...`` with coordinator flags (``tools/launch_local.py``
on one machine). Modules: transport (arrays on ``jax.experimental.transfer``,
control messages on the ``jax.distributed`` key-value store), satellite (a
training satellite in another process: the core's ``RemoteCell`` that
``ElasticStep.join`` accepts, and the satellite's ``serve`` loop), dp_job (job
'pods_dp': elastic steps with satellite processes joining mid-step).
"""
