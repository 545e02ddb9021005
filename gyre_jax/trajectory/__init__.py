"""gyre_jax.trajectory."""
