"""The RL run's LoRA section (``config.train.lora``): adapters instead of full fine-tuning (gyre_jax/model/lora.py).

``--config.train.lora.rank=16`` on any RL config turns it on; ``rl/lora_run.py`` is what the loop
builds from it (the frozen base, the adapters' steps, resume).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from gyre_jax.errors import ConfigError
from gyre_jax.schema import built, check_ints, check_positive

LORA_SERVING = ("auto", "merged", "unmerged")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraKnobs:
    """config.train.lora: LoRA adapters instead of full fine-tuning (gyre_jax/model/lora.py).

    rank > 0 turns it on: the base is frozen (held in the serving dtype, no gradient, no optimizer
    state), and the optimizer, the checkpoints, every role switch and every weight publication hold
    and move the adapters only."""

    SECTION: ClassVar[str] = "train.lora"
    rank: int = 0  # 0 = full fine-tuning; r > 0: adapters of rank r on the targets, the base frozen
    alpha: float = 32.0  # the update is (alpha / rank) x A @ B (alpha / sqrt(rank) with rslora)
    dropout: float = 0.0  # on the adapters' inputs, training only
    # comma-separated PEFT module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
    # on MoE layers the last three adapt every expert), or "all"
    targets: str = "all"
    layers: str = ""  # comma-separated layer indices or ranges ("0-11,20"); "" = every layer
    rslora: bool = False
    # merged: each engine serves the base with the adapter folded in (exact, no per-token cost; the
    # cell keeps the base to merge each new version into); unmerged: the engine applies the adapter
    # per token beside the base weights (what several adapters need); auto: merged for one adapter
    serve: str = "auto"
    init_from: str = ""  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to continue
    # Multi-LoRA: this many adapters over the one base, each its own task set and optimizer state; group g
    # trains adapter g % adapters, and the proxy routes its rollouts' calls to that adapter by their key.
    adapters: int = 1
    # Each adapter's task set: "|"-separated, per adapter ";"-separated overrides of config.task's fields,
    # e.g. "ops=copy|ops=upper"; "" = every adapter draws from config.task (its own stream of it).
    adapter_tasks: str = ""

    def __post_init__(self):
        check_ints(self, ("rank", "adapters"))
        check_positive(self, ("rank", "dropout"), allow_zero=True)
        check_positive(self, ("adapters",))
        if self.serve not in LORA_SERVING:
            raise ConfigError(f"config.train.lora.serve must be one of {LORA_SERVING}, got {self.serve!r}")
        if self.adapters > 1 and self.serve == "merged":
            raise ConfigError(f"config.train.lora.adapters={self.adapters}: serve='merged' folds one adapter into the "
                              "weights; several serve 'unmerged' (or 'auto')")
        if (self.adapters > 1 or self.adapter_tasks) and not self.rank:
            raise ConfigError("config.train.lora.adapters / adapter_tasks need config.train.lora.rank > 0")
        if self.adapter_tasks and len(self.adapter_tasks.split("|")) != self.adapters:
            raise ConfigError(f"config.train.lora.adapter_tasks={self.adapter_tasks!r} names "
                              f"{len(self.adapter_tasks.split('|'))} task sets for adapters={self.adapters}")
        if self.rank:
            self.lora_config()  # every field checked now, before any JAX work

    @property
    def serving(self) -> str:
        """How engines serve the adapters: merged for one adapter, unmerged for several (serve='auto')."""
        if self.serve != "auto":
            return self.serve
        return "merged" if self.adapters == 1 else "unmerged"

    def task_overrides(self) -> list[dict[str, str]]:
        """Each adapter's overrides of config.task (raw strings; RLConfig types them)."""
        if not self.adapter_tasks:
            return [{} for _ in range(self.adapters)]
        out = []
        for a, part in enumerate(self.adapter_tasks.split("|")):
            fields = {}
            for item in (x.strip() for x in part.split(";") if x.strip()):
                k, eq, v = item.partition("=")
                if not eq:
                    raise ConfigError(f"config.train.lora.adapter_tasks: adapter {a}'s {item!r} is not field=value")
                fields[k.strip()] = v.strip()
            out.append(fields)
        return out

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def lora_config(self):
        """The model's LoraConfig (None when rank is 0)."""
        if not self.rank:
            return None
        from gyre_jax.model.lora import TARGETS, LoraConfig

        targets = TARGETS if self.targets.strip() in ("all", "") else tuple(
            t.strip() for t in self.targets.split(",") if t.strip())
        return built("train.lora", lambda: LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                                                       targets=targets, layers=_layer_list(self.layers),
                                                       rslora=self.rslora, num_adapters=self.adapters))


def _layer_list(text: str) -> tuple[int, ...]:
    """"0-3,7" -> (0, 1, 2, 3, 7); ConfigError naming config.train.lora.layers otherwise."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, sep, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
        except ValueError:
            raise ConfigError(f"config.train.lora.layers={text!r}: {part!r} is not a layer index or a range "
                              "like 0-11") from None
    return tuple(out)


# ---------------------------------------------------------------------------- what RLConfig asks of it
def check_lora(cfg) -> None:
    """The adapters fit ``cfg``'s model (layers, MoE, parallelism); each adapter's task set builds and has
    held-out tasks (``cfg``: an RLConfig)."""
    lora = cfg.train.lora
    if lora.enabled:
        built("train.lora", lambda: cfg.policy_model)
    if lora.adapters <= 1:
        return
    for src in cfg.adapter_sources:
        built("train.lora.adapter_tasks", lambda: src.train_task(0))  # noqa: B023 - called at once
        if cfg.eval.every and not src.eval_tasks(1):
            raise ConfigError(f"config.train.lora.adapter_tasks: {src.describe()} has no held-out tasks")
    if cfg.eval.every and cfg.eval.kind != "first_call":
        raise ConfigError("config.train.lora.adapters > 1: the held-out eval of each adapter on each task set is "
                          "eval.kind='first_call' (whole-episode evals per adapter are not covered)")


def adapter_sources(cfg) -> list:
    """Each LoRA adapter's TaskSource: ``cfg.task`` with the adapter's overrides (train.lora.adapter_tasks),
    each field typed by the task section's own field."""
    from gyre_jax.schema import from_mapping, knobs

    out = []
    types = {f.name: f.type for f in knobs(cfg.task)}
    if cfg.task.family_options is not None:  # a family's option spelled flat (ops=copy) goes to its options
        types = {**{f.name: f.type for f in dataclasses.fields(cfg.task.family_options)}, **types}
    for a, over in enumerate(cfg.train.lora.task_overrides()):
        typed: dict = {}
        for k, v in over.items():
            kind = str(types.get(k, "str"))
            try:
                typed[k] = int(v) if kind == "int" else float(v) if kind == "float" else v
            except ValueError:
                raise ConfigError(f"config.train.lora.adapter_tasks: adapter {a}'s {k}={v!r} is not a {kind}") from None
        task = from_mapping(type(cfg.task), typed, f"train.lora.adapter_tasks (adapter {a})", base=cfg.task)
        out.append(built("task", lambda: task.source(cfg.seed + a)))  # noqa: B023 - called at once
    return out


def switch_move_bytes(cfg) -> int:
    """Bytes one role switch or publication moves: the params, or a LoRA run's adapters (float32)."""
    import math

    from gyre_jax import planner

    lora = cfg.lora
    if lora is None:
        return sum(math.prod(s) for _, s, _ in planner.param_table(cfg.model)) * planner.DTYPE_BYTES[
            cfg.model.param_dtype]
    return 4 * sum(math.prod(s) for _, s, _ in planner.lora_table(cfg.model, lora))
