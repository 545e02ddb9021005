"""gyre_jax.testing."""
