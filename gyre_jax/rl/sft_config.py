"""The RL run's sft section (``config.sft``): the supervised warm start on scripted demonstrations
(``gyre_jax.rl.sft`` runs it; this module stays light, for config files)."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from gyre_jax.errors import ConfigError
from gyre_jax.schema import check_positive

NOISE_KINDS = ("reverse", "one_char", "random", "give_up")  # gyre_jax.rl.sft.noisy_tasks


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    SECTION: ClassVar[str] = "sft"
    steps: int = 600  # supervised steps on scripted demonstrations (0: no warm start)
    rows: int = 6  # packed rows per step
    learning_rate: float = 1e-3
    demos: int = 512  # distinct demonstration tasks (cycled)
    # Fraction of demonstrations that are deliberately bad (a wrong answer, or giving up;
    # 'tiny' family only, see gyre_jax.rl.sft.noisy_tasks). 0 = clean.
    # > 0 is meant to leave the warm-started policy right only part of the time (headroom
    # and reward variance for RL); measured results in docs/results.md.
    noisy_fraction: float = 0.0
    noisy_kind: str = "reverse"  # how a demonstration is bad: reverse | one_char | random | give_up
    # A directory of warm starts keyed by what determines them (gyre_jax.rl.warm_cache): runs that
    # differ only in RL knobs (mode, loss, steps) train the warm start once. "" = off.
    cache_dir: str = ""
    # The warm start's seed (init and demonstration order); -1 = config.seed. Set, runs that differ
    # only in config.seed share one warm start: a spread over RL seeds from the same starting point.
    seed: int = -1

    def __post_init__(self):
        check_positive(self, ("steps", "demos"), allow_zero=True)
        check_positive(self, ("rows", "learning_rate"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < -1:
            raise ConfigError(f"config.sft.seed must be an int >= -1 (-1 = config.seed), got {self.seed!r}")
        if not 0.0 <= self.noisy_fraction < 1.0:
            raise ConfigError(f"config.sft.noisy_fraction must be in [0, 1), got {self.noisy_fraction!r}")
        if self.noisy_kind not in NOISE_KINDS:
            raise ConfigError(f"config.sft.noisy_kind={self.noisy_kind!r}; known: {NOISE_KINDS}")
