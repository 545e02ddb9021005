"""gyre_jax.scheduler."""
# The built-in scheduling modes register themselves on import: a PolicyConfig built from any
# scheduler module finds them (policy_config holds the registry, modes fills it).
from gyre_jax.scheduler import modes as _modes  # noqa: F401
