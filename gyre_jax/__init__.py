"""gyre_jax: elastic online RL for long-horizon LLM agents, in JAX.

Subpackages (see docs/design.md): model, losses, trajectory, cells, serving,
scheduler, agents, testing. Nothing is imported here so that, e.g.,
``import gyre_jax.losses`` stays light.
"""

__version__ = "0.1.0"
