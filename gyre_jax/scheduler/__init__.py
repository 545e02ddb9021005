"""gyre_jax.scheduler."""
