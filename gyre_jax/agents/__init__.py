"""gyre_jax.agents."""
