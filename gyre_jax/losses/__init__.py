"""gyre_jax.losses."""
