"""The RL run's train section (``config.train``): one object the optimizer, the loss and the processor take.

``TrainConfig`` is an ``OptimizerConfig`` (``cells.make_optimizer``), a ``PolicyLossConfig``
(``cells.loss.policy_loss_fn``: the loss, the train-inference correction, KL, entropy) and a
``ProcessorConfig`` (``trajectory.process_step``: advantages, paths, packing, token weights), plus
the trainer's own knobs; each of them reads its own fields, so none is copied.

The objective is four names, one per registry of ``gyre_jax.losses`` (the README lists every
entry with its paper): ``loss``, ``advantage``, ``weights`` and ``mismatch`` (or "off"). Each
entry's options are its own typed sub-section: ``--config.train.loss=gspo
--config.train.loss_options.gspo.eps_low=3e-4``; the chosen entry's schema validates them, and
options set for an entry the config does not choose are an error naming both.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from gyre_jax.cells.train_state import OptimizerConfig
from gyre_jax.errors import ConfigError
from gyre_jax.losses import ADVANTAGE_ESTIMATORS
from gyre_jax.losses.policy_gradient import PolicyLossConfig
from gyre_jax.rl.lora_config import LoraKnobs
from gyre_jax.schema import check_ints, check_positive
from gyre_jax.trajectory.processor import ProcessorConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(OptimizerConfig, PolicyLossConfig, ProcessorConfig):
    SECTION: ClassVar[str] = "train"
    row_len: int = 160  # packed row length L
    micro_batch_rows: int = 2  # rows per micro-batch (one compiled shape)
    learning_rate: float = 1e-4  # AdamW (3e-4+ degrades the demo's sharp SFT minimum)
    adam_eps: float = 1e-8  # larger values damp Adam's full-size steps on rarely-seen tokens' rows
    # DAPO dynamic sampling: drop groups whose rewards are all equal, launch replacements;
    # at most dynamic_sampling_budget x groups_per_step x steps groups over the run.
    dynamic_sampling: bool = False
    dynamic_sampling_budget: float = 1.0
    work_s_per_row: float = 0.05  # initial estimate of training cell-seconds per row (then measured)
    # MoE models: the training forward uses the experts the engine recorded for each sampled token
    # (rollout routing replay, R3; gyre_jax/model/moe.py) instead of re-routing it live. Either way
    # the step reports routing_mismatch, the fraction of trained tokens whose live routing differs.
    routing_replay: bool = False
    lora: LoraKnobs = LoraKnobs()  # LoRA instead of full fine-tuning: --config.train.lora.rank=16 (rl/lora_config.py)

    def __post_init__(self):
        OptimizerConfig.__post_init__(self)
        PolicyLossConfig.__post_init__(self)
        ProcessorConfig.__post_init__(self)
        check_positive(self, ("row_len", "micro_batch_rows", "learning_rate", "max_grad_norm", "work_s_per_row",
                              "adam_eps"))
        for name in ("routing_replay", "dynamic_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config.train.{name} must be True or False, got {getattr(self, name)!r}")
        check_positive(self, ("dynamic_sampling_budget",), allow_zero=True)
        check_ints(self, ("overlong_max_tokens", "overlong_buffer_tokens"))
        if not isinstance(self.lora, LoraKnobs):
            raise ConfigError(f"config.train.lora must be a LoraKnobs section, got {self.lora!r}")

    @property
    def scope(self) -> str:
        """``group`` or ``step``: what the advantage estimator needs before a group can train."""
        return ADVANTAGE_ESTIMATORS.get(self.advantage).scope
