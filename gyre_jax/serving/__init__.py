"""gyre_jax.serving."""
