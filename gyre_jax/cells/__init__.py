"""gyre_jax.cells."""
