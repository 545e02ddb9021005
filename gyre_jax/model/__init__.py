"""gyre_jax.model."""
